"""Core AI on Linux: the project's own torch modules as `.aimodel` programs, run by coreai-core's
bundled CPU runtime and compared with torch.

For a tiny random config (llama_ane.testing.TINY_CONFIG), the embeddings (`Embeddings`) and a
one-layer block chunk (`BlockChunk`) are exported with torch.export, converted by coreai-torch into
one `.aimodel` each with a `prefill` (window S) and a `decode` (window 1) function, and saved. Each
asset is then parsed back with coreai-core's own bindings (functions, I/O, operation counts, the
largest tensor dimension against llama_ane.limits.MAX_DIM) and executed: Linux has no Core AI
framework, so `AIModelAsset.executable()` lowers the program to ODIX and loads it into the runtime
inside the wheel, CPU only. Each output is compared with the torch module's.

Needs Python >= 3.11 and the `coreai` extra (`pip install -e ".[coreai]"`), or an environment with
torch and the pinned coreai packages and this checkout on PYTHONPATH (docs/coreai.md):

    PYTHONPATH=. python benchmarks/coreai_probe.py [--dtype fp32|fp16] [--window 8] [--context 32]
        [--out DIR]

Exits 1 if an output differs from torch (shape, or values beyond the tolerance of its dtype).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from llama_ane.config import LlamaConfig
from llama_ane.export.coreai import structure, write_asset
from llama_ane.limits import MAX_DIM
from llama_ane.model import chunk, embeddings
from llama_ane.model.functions import Layout, shape_of
from llama_ane.testing import TINY_CONFIG

DTYPES = {"fp32": torch.float32, "fp16": torch.float16}
# Largest |coreai - torch| allowed, relative to max(1, max |torch|): fp32 differs only in the
# order of summation; fp16 rounds every intermediate.
TOLERANCE = {"fp32": 1e-4, "fp16": 2e-2}
VOCAB = 320
CACHED = 5  # positions already in the cache when the window runs


def coreai_modules() -> dict[str, Any]:
    """The coreai entry points used here; one `Error:` line and a non-zero exit where they are missing."""
    try:
        from coreai.authoring.asset import AIModelAsset
        from coreai.runtime import NDArray
    except ImportError as e:
        sys.exit(f"Error: {e.name or e} is not importable; install the pinned Core AI packages with "
                 f"pip install -e \".[coreai]\" (Python >= 3.11)")
    return {"AIModelAsset": AIModelAsset, "NDArray": NDArray}


def randomize(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Random weights as make_tiny_checkpoint draws them (normal, std 0.15), norm weights near 1."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.1 * noise if name.endswith("norm.weight") else 0.15 * noise)
    return module.eval()


def describe(path: Path, dtype: str) -> list[str]:
    """What coreai-core's own bindings read back from the saved program, without running it
    (llama_ane.export.coreai.structure, as `llama-ane inspect` reads an export's assets)."""
    found, violations = structure(path, dtype)
    lines = []
    for fn, io in found["functions"].items():
        ins, outs = (", ".join(f"{n}: {d}{s}" for n, (d, s) in io[k].items()) for k in ("inputs", "outputs"))
        lines.append(f"  function {fn}({ins}) -> {outs}")
    ops = sorted(found["operations"].items(), key=lambda kv: (-kv[1], kv[0]))
    lines.append("  operations: " + ", ".join(f"{name} x{count}" for name, count in ops))
    largest, where = found["largest_dim"]
    lines.append(f"  largest tensor dimension: {largest} ({where}), limit {MAX_DIM}")
    lines += [f"  rule broken: {rule}: {fn or ''} {message}" for rule, fn, message in violations]
    return lines


async def execute(asset: Any, nd: Any, inputs: dict[str, dict[str, torch.Tensor]]) -> dict[str, dict[str, np.ndarray]]:
    """Every function of `asset` on its inputs, through coreai-core's runtime."""
    results = {}
    async with asset.executable() as model:
        for fn, feed in inputs.items():
            out = await model.load_function(fn)({k: nd(v.numpy()) for k, v in feed.items()})
            results[fn] = {k: v.numpy() for k, v in out.items()}
    return results


def compare(name: str, got: dict[str, dict[str, np.ndarray]], want: dict[str, dict[str, torch.Tensor]],
            tolerance: float) -> bool:
    ok = True
    for fn, outputs in want.items():
        for out, ref in outputs.items():
            ref, mine = ref.detach().float().numpy(), got[fn][out].astype(np.float32)
            if mine.shape != ref.shape:
                print(f"  {name}.{fn}.{out}: coreai returned shape {mine.shape}, torch {ref.shape} MISMATCH")
                ok = False
                continue
            diff = float(np.abs(mine - ref).max())
            good = diff <= tolerance * max(1.0, float(np.abs(ref).max()))
            ok &= good
            print(f"  {name}.{fn}.{out} {tuple(ref.shape)}: max |coreai - torch| = {diff:.3g} "
                  f"(max |torch| {float(np.abs(ref).max()):.3g}) {'ok' if good else 'MISMATCH'}")
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    ap.add_argument("--window", type=int, default=8, help="prefill window S (decode is 1)")
    ap.add_argument("--context", type=int, default=32, help="cache positions T")
    ap.add_argument("--out", type=Path, help="folder for the .aimodel assets (default: a temporary one)")
    args = ap.parse_args()
    if not 1 <= args.window <= args.context or args.context <= CACHED:
        sys.exit(f"Error: need 1 <= --window <= --context and --context > {CACHED}; "
                 f"got --window {args.window} --context {args.context}")
    if args.out is not None and args.out.exists() and (not args.out.is_dir() or any(args.out.glob("*.aimodel"))):
        sys.exit(f"Error: --out {args.out} is a file or already holds .aimodel assets; choose another folder")
    lib = coreai_modules()
    dtype, torch_dtype = args.dtype, DTYPES[args.dtype]
    cfg = LlamaConfig.from_hf_dict({**TINY_CONFIG, "vocab_size": VOCAB}, "TINY_CONFIG")
    t = args.context
    # The tensor names and shapes each function declares for the manifest.
    layout = Layout(context_length=t, prefill_length=args.window, dtype="float32")
    emb_io, chunk_io = embeddings.functions(cfg, layout), chunk.functions(cfg, layout, 1)
    gen = torch.Generator().manual_seed(1)

    def run(module: torch.nn.Module, feed: dict[str, torch.Tensor], io: dict) -> dict[str, torch.Tensor]:
        with torch.no_grad():
            return dict(zip((o["name"] for o in io["outputs"]), module(**feed)))

    # The embeddings: one module per window (its buffers depend on S), one asset for both.
    emb = {fn: randomize(embeddings.Embeddings(cfg, t, shape_of(io, "input_ids")[1]), seed=0).to(torch_dtype)
           for fn, io in emb_io.items()}
    emb_in = {fn: {"input_ids": torch.randint(0, VOCAB, shape_of(io, "input_ids"), generator=gen, dtype=torch.int32),
                   "position": torch.tensor([CACHED], dtype=torch.int32)} for fn, io in emb_io.items()}
    emb_out = {fn: run(emb[fn], emb_in[fn], io) for fn, io in emb_io.items()}

    # A one-layer block chunk fed with those outputs and a random cache.
    block = randomize(chunk.BlockChunk(cfg, [0], t), seed=2).to(torch_dtype)
    cache = {n: torch.randn(shape_of(chunk_io["decode"], n), generator=gen).to(torch_dtype)
             for n in ("k_cache", "v_cache")}
    chunk_in = {fn: {**emb_out[fn], **cache} for fn in chunk_io}
    chunk_out = {fn: run(block, chunk_in[fn], io) for fn, io in chunk_io.items()}

    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        ok = True
        for name, modules, feeds, wants, io in (
                ("embeddings", emb, emb_in, emb_out, emb_io),
                ("chunk_0", {fn: block for fn in chunk_io}, chunk_in, chunk_out, chunk_io)):
            path = out / f"{name}.aimodel"
            write_asset(modules, io, torch_dtype, path)
            asset = lib["AIModelAsset"].load(path)
            print(f"{path.name} ({dtype}, T={t}, prefill S={args.window}): "
                  f"{', '.join(sorted(p.name for p in path.iterdir()))}")
            print("\n".join(describe(path, dtype)))
            got = asyncio.run(execute(asset, lib["NDArray"], feeds))
            ok &= compare(name, got, wants, TOLERANCE[dtype])
    print("Core AI matches torch" if ok else "Core AI differs from torch beyond the tolerance")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
