"""KV-Runahead on GPUs: time to first token against context length for one GPU, the
sequence-parallel baseline (all-gather of K/V) and KV-Runahead, all in one run, plus the
correctness checks (logits against one GPU, SmolLM2's greedy tokens after the runahead cache).

    python benchmarks/runahead_gpu.py --out-dir benchmarks/results [--smollm2-dir DIR]

With two or more GPUs every rank is a process on its own GPU, over NCCL:

* ``single``: rank 0 alone prefills the prompt (the others wait);
* ``sequence_parallel``: equal slabs, every layer's K/V all-gathered;
* ``kvr_even``: KV-Runahead with equal slabs (the paper's KVR-E);
* ``kvr_searched``: KV-Runahead with the partition found by the hierarchical grid search at that
  length (KVR-S); ``kvr_predicted``: interpolated from the searched lengths' table (KVR-P);
* ``kvr_searched_sdpa``: KVR-S with torch's flash attention over the gathered K/V instead of the
  project's shared-prefix kernel (which method attends is the only difference).

TTFT is the wall time from a barrier to the first token's id on the last rank (every rank
synchronised, the slowest rank counted), median of ``--reps`` after a warm-up. The timing model is
random weights in Llama-3.1-8B's shapes (bf16; time depends on shapes only).

With one GPU no multi-GPU time can be measured. The script then runs the correctness checks with
the ranks as threads on that GPU (gloo, K/V staged through host memory: the GPU kernels and the
hand-off to the decode engine are exercised, NCCL is not), times the single-GPU prefill, and gives
an *estimate* for ``--world`` GPUs: each rank's compute timed alone on the GPU (no communication,
ranks one after another), whose maximum bounds KV-Runahead's TTFT from below.

With ``--model-fit`` (one GPU) the partition comes from the rank cost model instead of a search:
the fitting partitions at those lengths are timed, the model fitted, the lookup table filled for
every context, and each model partition timed (``kvr_model_estimate``) beside the even split and
the searched one where ``--search`` names the length.

Writes ``runahead_gpu.json`` (every number, the searched partitions, the lookup table) and
``runahead_gpu.png`` to ``--out-dir``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SMOLLM2_TOKENS = 4096
SMOLLM2_NEW = 32
GRANULE = 256


# -- helpers used by every rank ----------------------------------------------------------------


class _Done:
    def wait(self) -> None:
        pass


class NullTransport:
    """A rank that talks to nobody (the one-GPU estimate): receives leave the prefix pages as
    they are, sends do nothing, the all-gather repeats the local slab."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world

    def send(self, tensor, dst, tag):
        return _Done()

    def recv(self, tensor, src, tag):
        return _Done()

    def all_gather(self, tensor):
        import torch

        return torch.cat([tensor] * self.world)


def _timer(dist_sync):
    """``timed(fn, reps)`` -> median seconds (slowest rank) and every rep's seconds."""
    import torch

    def sync():
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def timed(fn, reps):
        times = []
        for i in range(reps + 1):  # the first call warms up
            sync()
            dist_sync.barrier()
            t0 = time.perf_counter()
            fn()
            sync()
            dt = dist_sync.max(time.perf_counter() - t0)
            if i:
                times.append(dt)
        return statistics.median(times), times
    return timed


class _NcclSync:
    def __init__(self, rank: int) -> None:
        import torch
        import torch.distributed as dist

        self.dist, self.torch, self.rank = dist, torch, rank

    def barrier(self) -> None:
        self.dist.barrier(device_ids=[self.rank])

    def max(self, x: float) -> float:
        t = self.torch.tensor([x], device=f"cuda:{self.rank}", dtype=self.torch.float64)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX)
        return float(t.item())


class _LocalSync:
    def barrier(self) -> None:
        pass

    def max(self, x: float) -> float:
        return x


def _first_token(result):
    return None if result.logits is None else int(result.logits.argmax())


def _smollm2_prompt(tok, n: int) -> list[int]:
    text = (ROOT / "README.md").read_text() + "\n" + (ROOT / "docs" / "cuda.md").read_text()
    ids = tok(text)["input_ids"]
    while len(ids) < n:
        ids = ids + ids
    return ids[:n]


def _uneven_bounds(n: int, world: int, granule: int) -> list[int]:
    """A fixed uneven partition (earlier ranks take more, as the paper's searches found)."""
    from llama_ane.cuda.runahead.partition import bounds_from_fractions

    return bounds_from_fractions([2 * world - r for r in range(world)], n, granule)


def _compare_logits(got, want) -> dict:
    import torch

    got, want = got.float(), want.float()
    return dict(max_abs_diff=float((got - want).abs().max()),
                rel_l2=float((got - want).norm() / want.norm()),
                top1_equal=int(got.argmax()) == int(want.argmax()),
                top5_overlap=len(set(torch.topk(got, 5).indices.tolist())
                                 & set(torch.topk(want, 5).indices.tolist())))


def smollm2_check(engine, tok, world: int, rank: int, run_kvr, run_sp, log) -> dict | None:
    """KV-Runahead and sequence-parallel logits and 32 greedy tokens against one GPU (last rank
    reports). ``run_kvr(ids, bounds)`` / ``run_sp(ids)`` run this rank's share."""
    from llama_ane.cuda.runahead.prefill import single_prefill

    ids = _smollm2_prompt(tok, SMOLLM2_TOKENS)
    bounds = _uneven_bounds(len(ids), world, engine.page_size)
    kvr = run_kvr(ids, bounds)
    sp = run_sp(ids)
    if kvr.logits is None:
        return None
    single = single_prefill(engine, ids)
    plain = engine.generate(ids, [[]], SMOLLM2_NEW).tokens[0]
    after_single = engine.generate(ids, [[]], SMOLLM2_NEW, prefix_cache=single.cache).tokens[0]
    after_kvr = engine.generate(ids, [[]], SMOLLM2_NEW, prefix_cache=kvr.cache).tokens[0]
    after_sp = engine.generate(ids, [[]], SMOLLM2_NEW, prefix_cache=sp.cache).tokens[0]
    out = dict(prompt_tokens=len(ids), bounds=bounds, dtype=str(engine.dtype),
               kvr_vs_single=_compare_logits(kvr.logits, single.logits),
               sp_vs_single=_compare_logits(sp.logits, single.logits),
               tokens_engine_prefill=plain, tokens_after_single_prefill=after_single,
               tokens_after_kvr=after_kvr, tokens_after_sequence_parallel=after_sp,
               kvr_tokens_identical=after_kvr == plain,
               sp_tokens_identical=after_sp == plain,
               kvr_first_token=_first_token(kvr), text_after_kvr=tok.decode(after_kvr))
    log(f"SmolLM2 {len(ids)} tokens, bounds {bounds}: KV-Runahead logits vs one GPU "
        f"{out['kvr_vs_single']}; sequence parallel {out['sp_vs_single']}")
    log(f"SmolLM2 greedy {SMOLLM2_NEW} tokens after KV-Runahead identical to one GPU: "
        f"{out['kvr_tokens_identical']}; after sequence parallel: {out['sp_tokens_identical']}")
    log(f"SmolLM2 text after KV-Runahead: {out['text_after_kvr']!r}")
    return out


def random_logits_check(engine, world, rank, run_kvr, n, log) -> dict | None:
    import torch

    from llama_ane.cuda.runahead.prefill import single_prefill

    ids = torch.randint(0, 128256, (n,), generator=torch.Generator().manual_seed(7))
    bounds = _uneven_bounds(n, world, GRANULE)
    kvr = run_kvr(ids, bounds)
    if kvr.logits is None:
        return None
    single = single_prefill(engine, ids).logits
    # the rounding noise of this model: one GPU with two attention kernels of the same function
    out = dict(context=n, bounds=bounds, kvr_vs_single=_compare_logits(kvr.logits, single),
               single_sdpa_vs_single=_compare_logits(
                   single_prefill(engine, ids, method="sdpa").logits, single))
    log(f"Llama-3.1-8B shapes (random, bf16) {n} tokens: KV-Runahead logits vs one GPU "
        f"{out['kvr_vs_single']}; one GPU with torch's flash attention vs one GPU "
        f"{out['single_sdpa_vs_single']}")
    return out


def speed(engine, world, rank, transport, sync, args, log) -> dict:
    """The TTFT table over NCCL (every rank calls this)."""
    import torch

    from llama_ane.cuda.runahead.partition import PartitionTable, even_bounds, \
        hierarchical_grid_search
    from llama_ane.cuda.runahead.prefill import (runahead_prefill, sequence_parallel_prefill,
                                                 single_prefill)

    timed = _timer(sync)
    ids_all = torch.randint(0, 128256, (max(args.contexts),),
                            generator=torch.Generator().manual_seed(1))
    last = rank == world - 1

    def kvr(ids, bounds, method=None):
        def fn():
            r = runahead_prefill(engine, ids, bounds, transport, method=method)
            return _first_token(r)
        return fn

    table, searches, rows = PartitionTable(), {}, []
    for n in args.search:
        ids = ids_all[:n]
        log(f"search {n} tokens over {world} GPUs (granule {GRANULE})")
        res = hierarchical_grid_search(
            n, world, lambda b: timed(kvr(ids, b), args.search_reps)[0], granule=GRANULE,
            progress=lambda s: log("  " + s))
        table.add(res.bounds)
        searches[n] = dict(bounds=res.bounds, ms=res.seconds * 1e3, levels=res.levels,
                           measured={",".join(map(str, k)): v * 1e3
                                     for k, v in res.evaluated.items()})
        torch.cuda.empty_cache()
    for n in args.contexts:
        ids = ids_all[:n]
        plans = [("single", None, lambda: _first_token(single_prefill(engine, ids))
                  if rank == 0 else None),
                 ("sequence_parallel", even_bounds(n, world, engine.page_size),
                  lambda: _first_token(sequence_parallel_prefill(engine, ids, transport))),
                 ("kvr_even", even_bounds(n, world, GRANULE), None)]
        if n in searches:
            plans.append(("kvr_searched", searches[n]["bounds"], None))
            plans.append(("kvr_searched_sdpa", searches[n]["bounds"], None))
        elif table.entries:
            plans.append(("kvr_predicted", table.predict(n, world, GRANULE), None))
        for name, bounds, fn in plans:
            if fn is None:
                fn = kvr(ids, bounds, "sdpa" if name.endswith("sdpa") else None)
            try:
                med, reps = timed(fn, args.reps)
            except torch.cuda.OutOfMemoryError:
                log(f"{n:6d} {name:20s} out of GPU memory")
                torch.cuda.empty_cache()
                continue
            rows.append(dict(context=n, method=name, bounds=bounds, ttft_ms=med * 1e3,
                             reps_ms=[t * 1e3 for t in reps]))
            log(f"{n:6d} {name:20s} {med * 1e3:9.1f} ms  bounds {bounds}")
            torch.cuda.empty_cache()
    return dict(rows=rows, searches={str(k): v for k, v in searches.items()},
                table=table.to_json(), world=world, granule=GRANULE, last_rank=last)


# -- multi-GPU: one process per GPU ------------------------------------------------------------


def _rank_main(rank: int, world: int, args) -> None:
    import torch
    import torch.distributed as dist

    from llama_ane.cuda.runahead.model import random_engine
    from llama_ane.cuda.runahead.prefill import (Transport, runahead_prefill,
                                                 sequence_parallel_prefill)

    def log(msg):
        if rank == 0 or msg.startswith(("SmolLM2", "Llama")):
            print(f"[rank {rank}] {msg}", flush=True)

    transport = Transport(dist.group.WORLD)
    device = torch.device("cuda", rank)
    part = {}
    if args.smollm2_dir:
        from llama_ane.cuda.engine import SMOLLM2_GGUF, GPUEngine, load_hf_model

        model, tok = load_hf_model(args.smollm2_dir, SMOLLM2_GGUF)
        engine = GPUEngine(model, dtype=torch.float16, device=device)
        part["smollm2"] = smollm2_check(
            engine, tok, world, rank, lambda ids, b: runahead_prefill(engine, ids, b, transport),
            lambda ids: sequence_parallel_prefill(engine, ids, transport), log)
        del engine, model
        torch.cuda.empty_cache()
    engine = random_engine(device=device)
    part["random_8b"] = random_logits_check(
        engine, world, rank, lambda ids, b: runahead_prefill(engine, ids, b, transport), 4096, log)
    if not args.skip_speed:
        part["speed"] = speed(engine, world, rank, transport, _NcclSync(rank), args, log)
    (args.out_dir / f"runahead_rank{rank}.json").write_text(json.dumps(part, indent=1))


# -- one GPU ---------------------------------------------------------------------------------


def _thread_ranks(world: int, fn):
    """``fn(transport)`` on ``world`` gloo ranks, one thread each, CUDA tensors staged on host."""
    from llama_ane.cuda.runahead.launch import run_thread_ranks

    return run_thread_ranks(world, fn, host_staging=True)


def one_gpu(args, log) -> dict:
    import torch

    from llama_ane.cuda.runahead.model import random_engine
    from llama_ane.cuda.runahead.partition import even_bounds, hierarchical_grid_search
    from llama_ane.cuda.runahead.prefill import (runahead_prefill, sequence_parallel_prefill,
                                                 single_prefill)

    world = args.world
    out = dict(mode="one GPU: ranks as threads (gloo, host staging) for correctness; "
                    "per-rank compute timed alone for the estimate")
    if args.smollm2_dir:
        from llama_ane.cuda.engine import SMOLLM2_GGUF, GPUEngine, load_hf_model

        model, tok = load_hf_model(args.smollm2_dir, SMOLLM2_GGUF)
        engine = GPUEngine(model, dtype=torch.float16)
        box = {}

        def run_kvr(ids, bounds):
            res = _thread_ranks(world, lambda t: runahead_prefill(engine, ids, bounds, t))
            box["sp"] = _thread_ranks(world, lambda t: sequence_parallel_prefill(engine, ids,
                                                                                 t))[-1]
            return res[-1]

        out["smollm2"] = smollm2_check(engine, tok, world, world - 1, run_kvr,
                                       lambda ids: box["sp"], log)
        del engine, model
        torch.cuda.empty_cache()
    engine = random_engine(device="cuda")
    if not args.skip_checks:
        out["random_8b"] = random_logits_check(
            engine, world, world - 1,
            lambda ids, b: _thread_ranks(world, lambda t: runahead_prefill(engine, ids, b, t))[-1],
            4096, log)
    if args.skip_speed:
        return out
    timed = _timer(_LocalSync())
    ids_all = torch.randint(0, 128256, (max(args.contexts),),
                            generator=torch.Generator().manual_seed(1))
    rows, searches = [], {}

    def per_rank_ms(ids, bounds, reps=args.reps):
        return [timed(lambda r=r: runahead_prefill(engine, ids, bounds, NullTransport(r, world)),
                      reps)[0] * 1e3 for r in range(world)]

    for n in args.contexts:
        ids = ids_all[:n]
        med, reps = timed(lambda: _first_token(single_prefill(engine, ids)), args.reps)
        rows.append(dict(context=n, method="single", ttft_ms=med * 1e3,
                         reps_ms=[t * 1e3 for t in reps]))
        log(f"{n:6d} single               {med * 1e3:9.1f} ms (measured)")
        for name, bounds in (("kvr_even", even_bounds(n, world, GRANULE)),):
            ranks = per_rank_ms(ids, bounds)
            rows.append(dict(context=n, method=name + "_estimate", bounds=bounds,
                             per_rank_compute_ms=ranks, ttft_ms=max(ranks), estimate=True))
            log(f"{n:6d} {name}_estimate    {max(ranks):9.1f} ms  per-rank compute {ranks}")
        if n in args.search:
            res = hierarchical_grid_search(n, world,
                                           lambda b: max(per_rank_ms(ids, b, args.search_reps))
                                           / 1e3,
                                           granule=GRANULE, progress=lambda s: log("  " + s))
            ranks = per_rank_ms(ids, res.bounds)
            searches[str(n)] = dict(bounds=res.bounds, estimate_ms=max(ranks))
            rows.append(dict(context=n, method="kvr_searched_estimate", bounds=res.bounds,
                             per_rank_compute_ms=ranks, ttft_ms=max(ranks), estimate=True))
            log(f"{n:6d} kvr_searched_estimate {max(ranks):9.1f} ms  bounds {res.bounds} "
                f"per-rank compute {ranks}")
        torch.cuda.empty_cache()
    if args.model_fit:
        out["model"] = model_partitions(args, world, ids_all, per_rank_ms, rows, log)
    out["speed"] = dict(rows=rows, searches=searches, world=world, granule=GRANULE,
                        note="*_estimate rows: the slowest rank's compute alone on one GPU, no "
                             "communication (a lower bound of KV-Runahead's TTFT on "
                             f"{world} GPUs), not a multi-GPU measurement")
    return out


def model_partitions(args, world, ids_all, per_rank_ms, rows, log) -> dict:
    """The partition in seconds: time the few fitting partitions (every rank's compute), fit the
    rank cost model, fill the lookup table for ``args.contexts`` from it, then time each model
    partition (the check: against the even split, and against the searched one where this run
    searched). ``choose_seconds`` counts the fitting runs and the fill."""
    from llama_ane.cuda.runahead.partition import (fit_rank_cost_model, fitting_partitions)

    started = time.perf_counter()
    parts = fitting_partitions(args.model_fit, world, GRANULE)
    samples = [(b, [ms / 1e3 for ms in per_rank_ms(ids_all[:b[-1]], b, args.search_reps)])
               for b in parts]
    model = fit_rank_cost_model(samples, world)
    table = model.fill_table(args.contexts, GRANULE)
    choose_s = time.perf_counter() - started
    log(f"model for {world} GPUs from {len(parts)} timed partitions in {choose_s:.1f} s: "
        f"{model.to_json()['coef']}")
    checks = []
    for n in args.contexts:
        bounds = table.predict(n, world, GRANULE)
        ranks = per_rank_ms(ids_all[:n], bounds)
        rows.append(dict(context=n, method="kvr_model_estimate", bounds=bounds,
                         per_rank_compute_ms=ranks, ttft_ms=max(ranks), estimate=True,
                         model_predicted_ms=model.ttft(bounds) * 1e3))
        by = {r["method"]: r for r in rows if r["context"] == n}
        check = dict(context=n, bounds=bounds, model_ms=max(ranks),
                     predicted_ms=model.ttft(bounds) * 1e3,
                     even_ms=by.get("kvr_even_estimate", {}).get("ttft_ms"),
                     searched_ms=by.get("kvr_searched_estimate", {}).get("ttft_ms"),
                     searched_bounds=by.get("kvr_searched_estimate", {}).get("bounds"))
        checks.append(check)
        log(f"{n:6d} kvr_model_estimate    {max(ranks):9.1f} ms  bounds {bounds} (predicted "
            f"{check['predicted_ms']:.1f} ms; even {check['even_ms']}; searched "
            f"{check['searched_ms']} at {check['searched_bounds']})")
    return dict(model.to_json(), fitting_partitions=parts,
                fitting_ms=[[t * 1e3 for t in ts] for _, ts in samples],
                choose_seconds=choose_s, table=table.to_json(), checks=checks,
                note="per-rank compute of each partition timed alone on one GPU (no "
                     "communication): the model and its check are of that estimate")


# -- report ------------------------------------------------------------------------------------


def plot(rows, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for method in dict.fromkeys(r["method"] for r in rows):
        pts = sorted((r["context"], r["ttft_ms"]) for r in rows if r["method"] == method)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                linestyle="--" if method.endswith("estimate") else "-", label=method)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("time to first token (ms)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def summary(rows) -> list[str]:
    by = {(r["context"], r["method"]): r["ttft_ms"] for r in rows}
    lines = []
    for n in sorted({r["context"] for r in rows}):
        one = by.get((n, "single"))
        parts = []
        for (m_n, method), ms in by.items():
            if m_n == n:
                ratio = f" ({one / ms:.2f}x)" if one and method != "single" else ""
                parts.append(f"{method} {ms:.1f} ms{ratio}")
        lines.append(f"{n:6d}: " + "; ".join(parts))
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--world", type=int, help="GPUs (default: all); with one GPU, the ranks "
                                              "of the correctness checks and the estimate")
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 8192, 16384, 24576, 32768])
    ap.add_argument("--search", type=int, nargs="*", default=[8192, 16384, 32768],
                    help="contexts whose partition is searched (the others are interpolated)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--search-reps", type=int, default=1)
    ap.add_argument("--smollm2-dir", type=Path, help="folder with the SmolLM2 GGUF")
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument("--model-fit", type=int, nargs="*", default=[],
                    help="one GPU: fit the rank cost model from the fitting partitions at these "
                         "lengths and time its partition at every context")
    ap.add_argument("--skip-checks", action="store_true",
                    help="leave out the correctness checks (logits, SmolLM2)")
    args = ap.parse_args()

    import torch

    if not torch.cuda.is_available():
        print("Error: benchmarks/runahead_gpu.py needs a CUDA GPU", file=sys.stderr)
        return 2
    if any(n % GRANULE for n in args.contexts + args.search):
        print(f"Error: contexts must be multiples of {GRANULE}", file=sys.stderr)
        return 2
    args.search = [n for n in args.search if n in args.contexts]
    gpus = torch.cuda.device_count()
    args.world = args.world or max(gpus, 2)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    started = time.time()
    report = dict(device=torch.cuda.get_device_name(0), gpus=gpus, world=args.world,
                  torch=torch.__version__, contexts=args.contexts, reps=args.reps,
                  shapes="Llama-3.1-8B (random weights, bf16)")
    if gpus >= args.world >= 2:
        from llama_ane.cuda.runahead.launch import spawn

        report["mode"] = f"{args.world} GPUs, one process each, NCCL"
        spawn(_rank_main, args.world, "nccl", (args,))
        parts = [json.loads((args.out_dir / f"runahead_rank{r}.json").read_text())
                 for r in range(args.world)]
        for r in range(args.world):
            (args.out_dir / f"runahead_rank{r}.json").unlink()
        for key in ("smollm2", "random_8b"):
            report[key] = next((p[key] for p in parts if p.get(key)), None)
        if "speed" in parts[0]:
            report["speed"] = parts[0]["speed"]
    else:
        report.update(one_gpu(args, lambda m: print(m, flush=True)))
    report["seconds"] = time.time() - started
    json_path = args.out_dir / "runahead_gpu.json"
    json_path.write_text(json.dumps(report, indent=1) + "\n")
    rows = (report.get("speed") or {}).get("rows", [])
    if rows:
        plot(rows, args.out_dir / "runahead_gpu.png",
             f"TTFT, Llama-3.1-8B shapes, {report['mode'].split(':')[0]} ({report['device']})")
        print("\n".join(summary(rows)))
    print(f"wrote {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
