"""What a verify window of S tokens costs on this CPU against one decode step: the projections
and the attention.

A speculative step pays off when verifying a window of S drafted tokens costs little more than
decoding one. On a CPU the projections (every decoder layer's q/k/v/o and MLP matrices, and the LM
head) are most of a step. This times all of them, with weights of the model's shapes (random,
float32), for S = 1..16 columns, two ways:

* `linear`: torch.nn.functional.linear, what an unpacked module runs;
* `onednn`: oneDNN on weights reordered once (`torch.ops.mkldnn._linear_pointwise`), what the
  torch backend runs with `prepack="onednn"` (`PackedConv1x1`);
* `native`: the native kernel on weights packed into panels (runtime/backends/native_gemm), what
  the torch backend runs by default where a C compiler builds it (`NativeConv1x1`).

It prints each time and its ratio to one column through the first of `--ways` (`linear` by default,
the way an unpacked decode step runs), measured in the same process; the best of --repeats runs.

Then it times the attention of every layer over a cache of `--cache` positions (650 by default, about
the document prompts of speculative.py; 0 for none), S query tokens of each query head, two ways:
`grouped_attention` through torch (chunks/layers.py, what the export traces and an unpacked module
runs) and the native kernel (runtime/backends/native_attention, what the torch backend runs with
the native packing), with ratios to one token through torch.

`--shapes 1b|3b|8b` takes the shapes of Llama-3.2-1B, Llama-3.2-3B or Llama-3.1-8B instead, the
sizes an ANE app deploys (export_scale.py's presets; `tiny` is a 2-layer toy for a quick check);
`--ways` picks which ways run. Each way but `linear` holds a second copy of the weights; what the
chosen ways need is checked against the memory available before anything is allocated.

    python benchmarks/verify_columns.py                 # SmolLM2-135M shapes, 1 thread
    python benchmarks/verify_columns.py --threads 2
    python benchmarks/verify_columns.py --shapes 1b --ways linear,native --cache 2000
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # export_scale.py, beside this script, has the presets
from export_scale import PRESETS, preset_config  # noqa: E402
from llama_ane.checkpoint.loader import load_checkpoint
from llama_ane.chunks.plan import layer_shapes
from llama_ane.config import LlamaConfig
from llama_ane.export.memory import GIB, available_bytes
from llama_ane.chunks.layers import MASK_VALUE, grouped_attention
from llama_ane.runtime.backends import native_attention, native_gemm

WAYS = ("linear", "onednn", "native")


def projection_shapes(cfg) -> list[tuple[int, int]]:
    """(out, in) of every projection of one forward pass, the LM head last."""
    layer = [shape for shape in layer_shapes(cfg).values() if len(shape) == 2]  # not the norms
    return layer * cfg.num_hidden_layers + [(cfg.vocab_size, cfg.hidden_size)]


def attention_times(cfg, cache: int, columns: list[int], repeats: int) -> list[tuple[int, float, float | None]]:
    """(S, seconds through torch, seconds through the native kernel or None) of every layer's
    attention: S query tokens over a cache of `cache` positions (each layer its own random cache,
    cut from a longer one as the pipeline cuts it) and the S tokens themselves, causally."""
    g, d = cfg.num_key_value_heads, cfg.head_dim
    r = cfg.num_attention_heads // g
    native = native_attention.available() and native_attention.supports(d)
    caches = [(torch.randn(g, d, cache + 64)[..., :cache], torch.randn(g, d, cache + 64)[..., :cache])
              for _ in range(cfg.num_hidden_layers)]
    rows = []
    for s in columns:
        q, kw, vw = torch.randn(g, r, d, s) / d ** 0.5, torch.randn(g, d, s), torch.randn(g, d, s)
        mask = torch.zeros(1, 1, s, cache + s)
        mask[0, 0, :, cache:] = torch.triu(torch.full((s, s), MASK_VALUE), 1)
        with torch.inference_mode():
            ways = [lambda f=f: [f(q, k, v, kw, vw, mask, r, cache) for k, v in caches]
                    for f in (grouped_attention, *([native_attention.attend] if native else []))]
            times = [best_time(run, repeats) for run in ways]
        rows.append((s, times[0], times[1] if native else None))
    return rows


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
    ap.add_argument("--shapes", default="smollm2", choices=PRESETS,
                    help="the model whose projection shapes are timed (default: the embedded SmolLM2-135M)")
    ap.add_argument("--ways", default=",".join(WAYS), help=f"comma-separated, from {', '.join(WAYS)}")
    ap.add_argument("--cache", type=int, default=650, help="cached positions the attention is timed over (0: none)")
    args = ap.parse_args(argv)
    ways = [w for w in args.ways.split(",") if w]
    if not ways or any(w not in WAYS for w in ways):
        raise SystemExit(f"--ways takes a comma-separated list of {', '.join(WAYS)}, got {args.ways!r}")
    torch.set_num_threads(args.threads)
    cfg = load_checkpoint(None).config if args.shapes == "smollm2" else LlamaConfig.from_hf_dict(preset_config(args.shapes))
    shapes = projection_shapes(cfg)
    need = 4 * sum(o * i for o, i in shapes) * (1 + sum(w != "linear" for w in ways))  # fp32, and a copy per packing
    room = available_bytes()
    if room is not None and need > 0.9 * room:
        raise SystemExit(f"{args.shapes} with {', '.join(ways)} needs about {need / GIB:.1f} GiB of weights and "
                         f"{room / GIB:.1f} GiB is available: leave out ways (--ways linear,native) or use smaller --shapes")
    if "native" in ways and not native_gemm.available():
        print(f"no native kernel: {native_gemm.unavailable()}")
        ways.remove("native")
    weights = [torch.randn(o, i) * 0.02 for o, i in shapes]
    packed = {"onednn": [torch.ops.mkldnn._reorder_linear_weight(w) for w in weights] if "onednn" in ways else None,
              "native": [native_gemm.pack(w) for w in weights] if "native" in ways else None}
    print(f"{args.shapes}: {cfg.num_hidden_layers} layers, {sum(w.numel() for w in weights) / 1e6:.1f}M projection "
          f"weights, {args.threads} thread(s), best of {args.repeats}; 'x step': over one column through "
          f"{ways[0]}")
    base = None
    print(f"{'columns':>7}" + "".join(f"  {w + ' ms':>9}  {'x step':>6}" for w in ways))
    for s in (int(c) for c in args.columns.split(",")):
        xs = {i: torch.randn(s, i) for i in {w.shape[1] for w in weights}}
        run = {
            "linear": lambda: [torch.nn.functional.linear(xs[w.shape[1]], w) for w in weights],
            "onednn": lambda: [torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none", [], "")
                               for w, p in zip(weights, packed["onednn"])],
            "native": lambda: [native_gemm.columns(xs[w.shape[1]].t(), p, w.shape[0])
                               for w, p in zip(weights, packed["native"])],
        }
        with torch.inference_mode():
            times = [best_time(run[w], args.repeats) for w in ways]
        base = times[0] if base is None else base
        print(f"{s:>7}" + "".join(f"  {t * 1e3:>9.1f}  {t / base:>6.2f}" for t in times))
    if args.cache > 0:
        print(f"attention of {cfg.num_hidden_layers} layers over {args.cache} cached positions; 'x step': over one "
              "token through torch")
        print(f"{'tokens':>7}  {'torch ms':>9}  {'x step':>6}  {'native ms':>9}  {'x step':>6}")
        rows = attention_times(cfg, args.cache, [int(c) for c in args.columns.split(",")], args.repeats)
        for s, torch_s, native_s in rows:
            native = f"  {native_s * 1e3:>9.2f}  {native_s / rows[0][1]:>6.2f}" if native_s is not None else "  (no native kernel)"
            print(f"{s:>7}  {torch_s * 1e3:>9.2f}  {torch_s / rows[0][1]:>6.2f}" + native)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
