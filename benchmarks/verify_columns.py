"""What a verify window of S tokens costs on this CPU against one decode step: the projections.

A speculative step pays off when verifying a window of S drafted tokens costs little more than
decoding one. On a CPU the projections (every decoder layer's q/k/v/o and MLP matrices, and the LM
head) are most of a step. This times all of them, with weights of the model's shapes (random,
float32), for S = 1..16 columns, two ways:

* `linear`: torch.nn.functional.linear, what an unpacked module runs;
* `onednn`: oneDNN on weights reordered once (`torch.ops.mkldnn._linear_pointwise`), what the
  torch backend runs with `prepack="onednn"` (`PackedConv1x1`);
* `native`: the native kernel on weights packed into panels (runtime/backends/native_gemm), what
  the torch backend runs by default where a C compiler builds it (`NativeConv1x1`).

It prints each time and its ratio to one column through `linear` (a plain decode step), measured
in the same process; the best of --repeats runs.

    python benchmarks/verify_columns.py                 # SmolLM2-135M shapes, 1 thread
    python benchmarks/verify_columns.py --threads 2
"""

from __future__ import annotations

import argparse
import time

import torch

from llama_ane.checkpoint.loader import load_checkpoint
from llama_ane.chunks.plan import layer_shapes
from llama_ane.runtime.backends import native_gemm


def projection_shapes(cfg) -> list[tuple[int, int]]:
    """(out, in) of every projection of one forward pass, the LM head last."""
    layer = [shape for shape in layer_shapes(cfg).values() if len(shape) == 2]  # not the norms
    return layer * cfg.num_hidden_layers + [(cfg.vocab_size, cfg.hidden_size)]


def best_time(run, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--columns", default="1,2,4,6,8,12,16")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = load_checkpoint(None).config
    weights = [torch.randn(o, i) * 0.02 for o, i in projection_shapes(cfg)]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w) for w in weights]
    native = [native_gemm.pack(w) for w in weights] if native_gemm.available() else None
    print(f"{cfg.num_hidden_layers} layers, {sum(w.numel() for w in weights) / 1e6:.1f}M projection weights, "
          f"{args.threads} thread(s), best of {args.repeats}; 'x step': over one column through linear")
    if native is None:
        print(f"no native kernel: {native_gemm.unavailable()}")
    base = None
    print(f"{'columns':>7}  {'linear ms':>9}  {'x step':>6}  {'onednn ms':>9}  {'x step':>6}  {'native ms':>9}  {'x step':>6}")
    for s in (int(c) for c in args.columns.split(",")):
        xs = {i: torch.randn(s, i) for i in {w.shape[1] for w in weights}}
        with torch.inference_mode():
            plain = best_time(lambda: [torch.nn.functional.linear(xs[w.shape[1]], w) for w in weights], args.repeats)
            pre = best_time(lambda: [torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none", [], "")
                                     for w, p in zip(weights, packed)], args.repeats)
            own = float("nan") if native is None else best_time(
                lambda: [native_gemm.columns(xs[w.shape[1]].t(), p, w.shape[0]) for w, p in zip(weights, native)],
                args.repeats)
        base = plain if base is None else base
        print(f"{s:>7}  {plain * 1e3:>9.1f}  {plain / base:>6.2f}  {pre * 1e3:>9.1f}  {pre / base:>6.2f}  "
              f"{own * 1e3:>9.1f}  {own / base:>6.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
