"""Palettization: llama-ane's batched torch k-means against coremltools' own k-means and uniform LUTs.

On real weights (SmolLM2-135M-Instruct's MLP and attention projections of a few layers, and a slice
of its embedding table), for 4- and 6-bit LUTs with one LUT per 16 output channels (the iOS18
default), each method is timed on the same 2 threads and its error measured as
||W - W_lut|| / ||W|| (unweighted: coremltools has no activation weighting).

  * llama-ane: `llama_ane.quantize.kmeans.lut_compress` (sorted groups, all groups' Lloyd
    iterations batched, companded start);
  * coremltools kmeans: `coremltools.optimize.coreml.palettize_weights(mode="kmeans")` on a one-op
    program holding the weight (needs `pip install kmeans1d scikit-learn`: coremltools clusters
    groups of at least 10000 fp16 values with kmeans1d and smaller ones with scikit-learn);
  * coremltools uniform: the same with `mode="uniform"`.

The coremltools LUTs are read back from the palettized program and expanded with coremltools'
own `constexpr_lut_to_dense.decompress`. Results go to benchmarks/results/palettize_compare.{json,md}.

    python benchmarks/palettize_compare.py [--layers 2] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import numpy as np
import torch

RESULTS = Path(__file__).parent / "results"
GROUP_SIZE = 16


def real_weights(layers: int) -> dict[str, np.ndarray]:
    """(out, in) fp16 weights of SmolLM2: q/o and the MLP projections of the first `layers` layers,
    and the first 8192 rows of the embedding table."""
    from llama_ane.checkpoint.loader import load_checkpoint

    ckpt = load_checkpoint(None)
    out = {}
    for i in range(layers):
        for name in ("self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
            key = f"model.layers.{i}.{name}.weight"
            out[key] = ckpt.tensor(key).to(torch.float16).numpy()
    out["model.embed_tokens.weight[:8192]"] = ckpt.rows("model.embed_tokens.weight", 0, 8192).to(torch.float16).numpy()
    return out


def ours(weight: np.ndarray, nbits: int) -> np.ndarray:
    from llama_ane.quantize.kmeans import lut_compress, lut_decompress

    indices, lut = lut_compress(weight, nbits, GROUP_SIZE)
    return lut_decompress(indices, lut)


def coremltools_lut(weight: np.ndarray, nbits: int, mode: str) -> tuple[np.ndarray, float]:
    """Palettize a one-op program holding `weight` with coremltools; the dense weight it stores and
    the seconds palettize_weights took."""
    import coremltools as ct
    import coremltools.optimize.coreml as cto
    from coremltools.converters.mil import Builder as mb
    from coremltools.converters.mil.mil.ops.defs.iOS18.compression import constexpr_lut_to_dense

    out_ch, in_ch = weight.shape

    @mb.program(input_specs=[mb.TensorSpec((1, in_ch), dtype=ct.converters.mil.mil.types.fp16)],
                opset_version=ct.target.iOS18)
    def prog(x):
        return mb.linear(x=x, weight=weight, name="y")

    model = ct.convert(prog, minimum_deployment_target=ct.target.iOS18, compute_precision=ct.precision.FLOAT16,
                       pass_pipeline=ct.PassPipeline.EMPTY, skip_model_load=True)
    config = cto.OptimizationConfig(global_config=cto.OpPalettizerConfig(
        mode=mode, nbits=nbits, granularity="per_grouped_channel", group_size=GROUP_SIZE, weight_threshold=0))
    t0 = time.perf_counter()
    palettized = cto.palettize_weights(model, config)
    seconds = time.perf_counter() - t0
    ops = [op for f in palettized._mil_program.functions.values() for op in f.operations
           if op.op_type == "constexpr_lut_to_dense"]
    assert len(ops) == 1, [op.op_type for f in palettized._mil_program.functions.values() for op in f.operations]
    op = ops[0]
    dense = constexpr_lut_to_dense.decompress(op.indices.val, op.lut.val, None)
    return np.asarray(dense).reshape(weight.shape), seconds


def rel_error(w: np.ndarray, approx: np.ndarray) -> float:
    w64, a64 = w.astype(np.float64), approx.astype(np.float64)
    return float(np.linalg.norm(w64 - a64) / np.linalg.norm(w64))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--bits", default="4,6")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    weights = real_weights(args.layers)
    total = sum(w.size for w in weights.values())
    rows = []
    for nbits in (int(b) for b in args.bits.split(",")):
        acc = {m: {"seconds": 0.0, "sq_err": 0.0} for m in ("llama-ane", "coremltools kmeans", "coremltools uniform")}
        norm = 0.0
        for name, w in weights.items():
            norm += float(np.sum(w.astype(np.float64) ** 2))
            t0 = time.perf_counter()
            mine = ours(w, nbits)
            acc["llama-ane"]["seconds"] += time.perf_counter() - t0
            for method, mode in (("coremltools kmeans", "kmeans"), ("coremltools uniform", "uniform")):
                dense, s = coremltools_lut(w, nbits, mode)
                acc[method]["seconds"] += s
                acc[method]["sq_err"] += float(np.sum((w.astype(np.float64) - dense.astype(np.float64)) ** 2))
            acc["llama-ane"]["sq_err"] += float(np.sum((w.astype(np.float64) - mine.astype(np.float64)) ** 2))
            print(f"lut{nbits} {name} {w.shape}: llama-ane error {rel_error(w, mine):.4f}", flush=True)
        for method, a in acc.items():
            row = {"bits": nbits, "method": method, "seconds": a["seconds"], "weights": total,
                   "weights_per_s": total / a["seconds"], "rel_error": (a["sq_err"] / norm) ** 0.5}
            rows.append(row)
            print(f"lut{nbits} {method:20s} {a['seconds']:8.2f} s  {row['weights_per_s'] / 1e6:7.2f} M weights/s  "
                  f"relative error {row['rel_error']:.4f}", flush=True)
    meta = {"weights": list(weights), "total_weights": total, "group_size": GROUP_SIZE, "threads": args.threads,
            "machine": platform.machine(), "torch": torch.__version__}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "palettize_compare.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    lines = [f"| LUT | method | seconds ({total / 1e6:.1f} M weights) | M weights/s | relative error |",
             "|---|---|---|---|---|"]
    lines += [f"| lut{r['bits']} | {r['method']} | {r['seconds']:.2f} | {r['weights_per_s'] / 1e6:.2f} | "
              f"{r['rel_error']:.4f} |" for r in rows]
    (RESULTS / "palettize_compare.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
