"""KV-Runahead on GPUs: time to first token against context length for one GPU, sequence
parallelism (all-gather of K/V, even and load-balanced) and KV-Runahead, all in one run, plus the
correctness checks (logits against one GPU, SmolLM2's greedy tokens after each parallel prefill).

    python benchmarks/runahead_gpu.py --out-dir benchmarks/results [--smollm2-dir DIR]

With two or more GPUs every rank is a process on its own GPU, over NCCL, and ``--methods`` picks
the rows (default: all five baselines):

* ``single``: rank 0 alone prefills the prompt (the others wait);
* ``sequence_parallel``: equal slabs, every layer's K/V all-gathered;
* ``sequence_parallel_zigzag``: load-balanced, ``2 * world`` chunks, rank r taking chunks r and
  ``2 * world - 1 - r`` (equal causal attention work), every layer's K/V all-gathered;
* ``kvr_even:H``: KV-Runahead with equal slabs (the paper's KVR-E);
* ``kvr_model:H``: KV-Runahead with the rank cost model's partition: the fitting partitions at the
  ``--model-fit`` lengths timed on these GPUs (every rank's time), the model fitted and the
  lookup table filled for every context (``choose_seconds`` in the JSON counts all of it);

``H`` is the hand-off (``--handoff``, default all of them: ``unbatched``, the receives posted up
front and one send a layer on the default group; ``batched``, one ``batch_isend_irecv`` a layer;
``links``, each link on its own process group). ``--search`` lengths add ``kvr_searched`` (the
hierarchical grid search, the model's check) and ``kvr_searched_sdpa`` (the same bounds with
torch's flash attention), with the first hand-off.

TTFT is the wall time from a barrier to the first token's id on the rank holding the last token
(every rank synchronised, the slowest rank counted), median of ``--reps`` after a warm-up; every
rank's own time is kept (``per_rank_ms``). The timing model is random weights in Llama-3.1-8B's
shapes (bf16; time depends on shapes only). ``NCCL_NVLS_ENABLE`` defaults to 0 (NVLink multicast
off); the NCCL variables in effect (``NCCL_P2P_DISABLE=1`` for the slowed interconnect) are in the
JSON, and ``--name`` keeps such a run's files apart.

With one GPU no multi-GPU time can be measured. The script then runs the correctness checks with
the ranks as threads on that GPU (gloo, K/V staged through host memory: the GPU kernels and the
hand-off to the decode engine are exercised, NCCL is not), times the single-GPU prefill, and gives
an *estimate* for ``--world`` GPUs: each rank's compute timed alone on the GPU (no communication,
ranks one after another), whose maximum bounds KV-Runahead's TTFT from below.

With ``--model-fit`` (one GPU) the partition comes from the rank cost model instead of a search:
the fitting partitions at those lengths are timed, the model fitted, the lookup table filled for
every context, and each model partition timed (``kvr_model_estimate``) beside the even split and
the searched one where ``--search`` names the length.

``--cpu`` is a dry run of the multi-GPU path without a GPU: ``--world`` processes over gloo on the
CPU, a tiny random Llama in fp32, every method, hand-off, check and the model fit; its times say
nothing of GPUs.

Writes ``runahead_gpu.json`` (every number, the partitions, the lookup tables; with ``--cpu``
``runahead_cpu_dryrun.json``) and the PNG beside it to ``--out-dir``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SMOLLM2_TOKENS = 4096
SMOLLM2_NEW = 32
GRANULE = 256
METHODS = ("single", "sequence_parallel", "sequence_parallel_zigzag", "kvr_even", "kvr_model")
NCCL_ENV = ("NCCL_P2P_DISABLE", "NCCL_NVLS_ENABLE", "NCCL_SHM_DISABLE", "NCCL_P2P_LEVEL")


# -- helpers used by every rank ----------------------------------------------------------------


class _Done:
    def wait(self) -> None:
        pass


class NullTransport:
    """A rank that talks to nobody (the one-GPU estimate): receives leave the prefix pages as
    they are, sends do nothing, the all-gather repeats the local slab."""

    handoff = "unbatched"

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
    """``timed(fn, reps)`` -> median seconds (slowest rank), every rep's seconds (slowest rank),
    and each rank's median seconds."""
    import torch

    def sync():
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def timed(fn, reps):
        times, ranks = [], []
        for i in range(reps + 1):  # the first call warms up
            sync()
            dist_sync.barrier()
            t0 = time.perf_counter()
            fn()
            sync()
            dt = dist_sync.gather(time.perf_counter() - t0)
            if i:
                times.append(max(dt))
                ranks.append(dt)
        return statistics.median(times), times, [statistics.median(r) for r in zip(*ranks)]
    return timed


class _DistSync:
    """Barrier, every rank's number and rank 0's object over the default group."""

    def __init__(self, device) -> None:
        import torch
        import torch.distributed as dist

        self.dist, self.torch, self.device = dist, torch, device

    def barrier(self) -> None:
        if self.device.type == "cuda":
            self.dist.barrier(device_ids=[self.device.index])
        else:
            self.dist.barrier()

    def gather(self, x: float) -> list[float]:
        t = self.torch.tensor([x], device=self.device, dtype=self.torch.float64)
        out = [self.torch.empty_like(t) for _ in range(self.dist.get_world_size())]
        self.dist.all_gather(out, t)
        return [float(o.item()) for o in out]

    def share(self, obj):
        box = [obj]
        self.dist.broadcast_object_list(box, src=0)
        return box[0]


class _LocalSync:
    def barrier(self) -> None:
        pass

    def gather(self, x: float) -> list[float]:
        return [x]

    def share(self, obj):
        return obj


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


def _against_one(engine, ids, bounds, runs, new_tokens: int = 0) -> dict:
    """Each of ``runs`` (name -> ``fn(ids, bounds)``, this rank's PrefillResult; every rank calls
    every run) against one GPU's prefill, where this rank holds the prompt's last token:
    ``{name}_vs_single`` (logits) and, with ``new_tokens``, the greedy tokens after its cache
    (``tokens_after_{name}``, ``{name}_tokens_identical`` to the engine's own prefill)."""
    from llama_ane.cuda.runahead.prefill import single_prefill

    out, single, plain = {}, None, None
    for name, run in runs.items():
        res = run(ids, bounds)
        if res.logits is None:
            continue
        if single is None:
            single = single_prefill(engine, ids)
            if new_tokens:
                plain = engine.generate(ids, [[]], new_tokens).tokens[0]
                out.update(tokens_engine_prefill=plain, tokens_after_single_prefill=engine.generate(
                    ids, [[]], new_tokens, prefix_cache=single.cache).tokens[0])
        out[f"{name}_vs_single"] = _compare_logits(res.logits, single.logits)
        if new_tokens:
            after = engine.generate(ids, [[]], new_tokens, prefix_cache=res.cache).tokens[0]
            out[f"tokens_after_{name}"] = after
            out[f"{name}_tokens_identical"] = after == plain
    return out


def _check_runs(handoffs, run_kvr, run_sp) -> dict:
    """The runs of the checks: KV-Runahead with every hand-off (``kvr`` the first), sequence
    parallel even (``sp``) and zigzag (``sp_zigzag``)."""
    runs = {("kvr" if i == 0 else f"kvr_{h}"): (lambda ids, b, h=h: run_kvr(ids, b, h))
            for i, h in enumerate(handoffs)}
    runs["sp"] = lambda ids, b: run_sp(ids, "even")
    runs["sp_zigzag"] = lambda ids, b: run_sp(ids, "zigzag")
    return runs


def smollm2_check(engine, tok, world: int, runs, handoffs, log) -> dict | None:
    """Logits and 32 greedy tokens after each of ``runs`` against one GPU (reported by the rank
    holding the last token of each)."""
    ids = _smollm2_prompt(tok, SMOLLM2_TOKENS)
    bounds = _uneven_bounds(len(ids), world, engine.page_size)
    out = _against_one(engine, ids, bounds, runs, SMOLLM2_NEW)
    if not out:
        return None
    out.update(prompt_tokens=len(ids), bounds=bounds, dtype=str(engine.dtype),
               kvr_handoff=handoffs[0])
    for name in runs:
        if f"{name}_vs_single" in out:
            log(f"SmolLM2 {len(ids)} tokens, {name}: logits vs one GPU {out[f'{name}_vs_single']}; "
                f"{SMOLLM2_NEW} greedy tokens identical: {out[f'{name}_tokens_identical']}")
    if "tokens_after_kvr" in out:
        out["text_after_kvr"] = tok.decode(out["tokens_after_kvr"])
        log(f"SmolLM2 text after KV-Runahead: {out['text_after_kvr']!r}")
    return out


def random_logits_check(engine, world, runs, handoffs, n, label, log) -> dict | None:
    import torch

    from llama_ane.cuda.runahead.prefill import single_prefill

    ids = torch.randint(0, engine.embed.shape[0], (n,),
                        generator=torch.Generator().manual_seed(7))
    bounds = _uneven_bounds(n, world, GRANULE)
    out = _against_one(engine, ids, bounds, runs)
    if not out:
        return None
    # the rounding noise of this model: one GPU with two attention kernels of the same function
    out.update(context=n, bounds=bounds, kvr_handoff=handoffs[0],
               single_sdpa_vs_single=_compare_logits(
                   single_prefill(engine, ids, method="sdpa").logits,
                   single_prefill(engine, ids).logits))
    for name in runs:
        if f"{name}_vs_single" in out:
            log(f"{label} {n} tokens, {name}: logits vs one GPU {out[f'{name}_vs_single']}")
    log(f"{label}: one GPU with torch's flash attention vs one GPU {out['single_sdpa_vs_single']}")
    return out


def speed(engine, world, rank, transports, sync, args, log) -> dict:
    """The TTFT table with one process per rank (every rank calls this): ``args.methods``, the
    KV-Runahead rows once per hand-off of ``transports``."""
    import torch

    from llama_ane.cuda.runahead.partition import (PartitionTable, even_bounds,
                                                   hierarchical_grid_search,
                                                   sequence_parallel_spans)
    from llama_ane.cuda.runahead.prefill import (runahead_prefill, sequence_parallel_prefill,
                                                 single_prefill)

    timed = _timer(sync)
    ids_all = torch.randint(0, engine.embed.shape[0], (max(args.contexts + args.model_fit),),
                            generator=torch.Generator().manual_seed(1))
    handoffs = list(transports)
    first = transports[handoffs[0]]

    def kvr(ids, bounds, transport, method=None):
        return lambda: _first_token(runahead_prefill(engine, ids, bounds, transport,
                                                     method=method))

    def sp(ids, layout):
        return lambda: _first_token(sequence_parallel_prefill(engine, ids, first, layout=layout))

    def single(ids):
        return lambda: _first_token(single_prefill(engine, ids)) if rank == 0 else None

    tables, models = {}, {}
    if "kvr_model" in args.methods:
        for h, t in transports.items():
            def per_rank_ms(ids, bounds, reps, t=t):
                return [x * 1e3 for x in timed(kvr(ids, bounds, t), reps)[2]]

            model, table, info = fit_partition_model(args, world, ids_all, per_rank_ms,
                                                     lambda m, h=h: log(f"[{h}] {m}"))
            # every rank timed the same numbers; rank 0's table is the one all ranks use
            tables[h] = PartitionTable(sync.share(table.to_json())["entries"])
            models[h] = (model, info)
    searches = {}
    for n in args.search:
        ids = ids_all[:n]
        log(f"search {n} tokens over {world} ranks (granule {GRANULE}, {handoffs[0]})")
        res = hierarchical_grid_search(
            n, world, lambda b: timed(kvr(ids, b, first), args.search_reps)[0], granule=GRANULE,
            progress=lambda m: log("  " + m))
        searches[n] = dict(bounds=res.bounds, ms=res.seconds * 1e3, levels=res.levels,
                           handoff=handoffs[0],
                           measured={",".join(map(str, k)): v * 1e3
                                     for k, v in res.evaluated.items()})
        torch.cuda.empty_cache()
    rows = []
    for n in args.contexts:
        ids = ids_all[:n]
        plans = []  # (method, hand-off, bounds, timed function)
        if "single" in args.methods:
            plans.append(("single", None, [0, n], single(ids)))
        for name, layout in (("sequence_parallel", "even"), ("sequence_parallel_zigzag", "zigzag")):
            if name not in args.methods:
                continue
            try:
                spans = sequence_parallel_spans(n, world, layout, engine.page_size)
            except ValueError as exc:
                log(f"{n:6d} {name}: {exc}")
                continue
            plans.append((name, None, sorted({b for r in spans for span in r for b in span}),
                          sp(ids, layout)))
        for h, t in transports.items():
            named = []
            if "kvr_even" in args.methods:
                named.append(("kvr_even", even_bounds(n, world, GRANULE), None))
            if h in tables:
                named.append(("kvr_model", tables[h].predict(n, world, GRANULE), None))
            if n in searches and h == handoffs[0]:
                named += [("kvr_searched", searches[n]["bounds"], None),
                          ("kvr_searched_sdpa", searches[n]["bounds"], "sdpa")]
            plans += [(name, h, b, kvr(ids, b, t, method)) for name, b, method in named]
        for name, h, bounds, fn in plans:
            method = name if h is None else f"{name}:{h}"
            try:
                med, reps, ranks = timed(fn, args.reps)
            except torch.cuda.OutOfMemoryError:
                log(f"{n:6d} {method:28s} out of GPU memory")
                torch.cuda.empty_cache()
                continue
            row = dict(context=n, method=method, handoff=h, bounds=bounds, ttft_ms=med * 1e3,
                       reps_ms=[x * 1e3 for x in reps], per_rank_ms=[x * 1e3 for x in ranks])
            if name == "kvr_model":
                row["model_predicted_ms"] = models[h][0].ttft(bounds) * 1e3
            rows.append(row)
            log(f"{n:6d} {method:28s} {med * 1e3:9.1f} ms  bounds {bounds}  per rank "
                f"{[round(x * 1e3, 1) for x in ranks]}")
            torch.cuda.empty_cache()
    return dict(rows=rows, searches={str(k): v for k, v in searches.items()},
                models={h: info for h, (_, info) in models.items()}, handoffs=handoffs,
                world=world, granule=GRANULE)


# -- several ranks: one process each -----------------------------------------------------------


def _rank_main(rank: int, world: int, args) -> None:
    import torch
    import torch.distributed as dist

    from llama_ane.cuda.runahead.model import LLAMA31_8B, TINY_LLAMA, random_engine
    from llama_ane.cuda.runahead.prefill import (Transport, runahead_prefill,
                                                 sequence_parallel_prefill)

    def log(msg):
        if rank == 0:
            print(f"[rank {rank}] {msg}", flush=True)

    def log_any(msg):
        print(f"[rank {rank}] {msg}", flush=True)

    # links: new_group is collective, every rank builds the transports in this order
    transports = {h: Transport(dist.group.WORLD, handoff=h) for h in args.handoff}
    device = torch.device("cpu") if args.cpu else torch.device("cuda", rank)

    def checks(engine):
        return _check_runs(
            args.handoff, lambda ids, b, h: runahead_prefill(engine, ids, b, transports[h]),
            lambda ids, layout: sequence_parallel_prefill(engine, ids, transports[args.handoff[0]],
                                                          layout=layout))

    part = {}
    if args.smollm2_dir:
        from llama_ane.cuda.engine import SMOLLM2_GGUF, GPUEngine, load_hf_model

        model, tok = load_hf_model(args.smollm2_dir, SMOLLM2_GGUF)
        engine = GPUEngine(model, dtype=torch.float16, device=device)
        part["smollm2"] = smollm2_check(engine, tok, world, checks(engine), args.handoff,
                                        log_any)
        del engine, model
        torch.cuda.empty_cache()
    if args.cpu:
        engine = random_engine(TINY_LLAMA, device=device, dtype=torch.float32)
        label = "tiny Llama (random, fp32)"
    else:
        engine = random_engine(LLAMA31_8B, device=device)
        label = "Llama-3.1-8B shapes (random, bf16)"
    if not args.skip_checks:
        part["random_8b"] = random_logits_check(engine, world, checks(engine), args.handoff,
                                                args.check_tokens, label, log_any)
    if not args.skip_speed:
        part["speed"] = speed(engine, world, rank, transports, _DistSync(device), args, log)
    (args.out_dir / f"{args.name}_rank{rank}.json").write_text(json.dumps(part, indent=1))


# -- one GPU ---------------------------------------------------------------------------------


def _thread_ranks(world: int, fn, handoff: str = "unbatched"):
    """``fn(transport)`` on ``world`` gloo ranks, one thread each, CUDA tensors staged on host."""
    from llama_ane.cuda.runahead.launch import run_thread_ranks

    return run_thread_ranks(world, fn, host_staging=True, handoff=handoff)


def _thread_checks(engine, args) -> dict:
    """The checks' runs with the ranks as threads: each returns the result of the rank holding
    the last token."""
    from llama_ane.cuda.runahead.prefill import runahead_prefill, sequence_parallel_prefill

    def holder(results):
        return next(r for r in results if r.logits is not None)

    return _check_runs(
        args.handoff,
        lambda ids, b, h: holder(_thread_ranks(
            args.world, lambda t: runahead_prefill(engine, ids, b, t), h)),
        lambda ids, layout: holder(_thread_ranks(
            args.world, lambda t: sequence_parallel_prefill(engine, ids, t, layout=layout))))


def one_gpu(args, log) -> dict:
    import torch

    from llama_ane.cuda.runahead.model import random_engine
    from llama_ane.cuda.runahead.partition import even_bounds, hierarchical_grid_search
    from llama_ane.cuda.runahead.prefill import runahead_prefill, single_prefill

    world = args.world
    out = dict(mode="one GPU: ranks as threads (gloo, host staging) for correctness; "
                    "per-rank compute timed alone for the estimate")
    if args.smollm2_dir:
        from llama_ane.cuda.engine import SMOLLM2_GGUF, GPUEngine, load_hf_model

        model, tok = load_hf_model(args.smollm2_dir, SMOLLM2_GGUF)
        engine = GPUEngine(model, dtype=torch.float16)
        out["smollm2"] = smollm2_check(engine, tok, world, _thread_checks(engine, args),
                                       args.handoff, log)
        del engine, model
        torch.cuda.empty_cache()
    engine = random_engine(device="cuda")
    if not args.skip_checks:
        out["random_8b"] = random_logits_check(engine, world, _thread_checks(engine, args),
                                               args.handoff, args.check_tokens,
                                               "Llama-3.1-8B shapes (random, bf16)", log)
    if args.skip_speed:
        return out
    timed = _timer(_LocalSync())
    ids_all = torch.randint(0, engine.embed.shape[0], (max(args.contexts + args.model_fit),),
                            generator=torch.Generator().manual_seed(1))
    rows, searches = [], {}

    def per_rank_ms(ids, bounds, reps=args.reps):
        return [timed(lambda r=r: runahead_prefill(engine, ids, bounds, NullTransport(r, world)),
                      reps)[0] * 1e3 for r in range(world)]

    for n in args.contexts:
        ids = ids_all[:n]
        med, reps, _ = timed(lambda: _first_token(single_prefill(engine, ids)), args.reps)
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


def fit_partition_model(args, world, ids_all, per_rank_ms, log):
    """The partition in seconds: time the few fitting partitions at ``args.model_fit`` lengths
    (``per_rank_ms(ids, bounds, reps)``: every rank's milliseconds), fit the rank cost model and
    fill the lookup table for ``args.contexts`` from it. Returns the model, the table and what
    the JSON keeps; ``choose_seconds`` counts the fitting runs and the fill."""
    from llama_ane.cuda.runahead.partition import fit_rank_cost_model, fitting_partitions

    started = time.perf_counter()
    parts = fitting_partitions(args.model_fit, world, GRANULE)
    samples = [(b, [ms / 1e3 for ms in per_rank_ms(ids_all[:b[-1]], b, args.search_reps)])
               for b in parts]
    model = fit_rank_cost_model(samples, world)
    table = model.fill_table(args.contexts, GRANULE)
    choose_s = time.perf_counter() - started
    log(f"model for {world} ranks from {len(parts)} timed partitions in {choose_s:.1f} s: "
        f"{model.to_json()['coef']}")
    return model, table, dict(model.to_json(), fitting_partitions=parts,
                              fitting_ms=[[t * 1e3 for t in ts] for _, ts in samples],
                              choose_seconds=choose_s, table=table.to_json())


def model_partitions(args, world, ids_all, per_rank_ms, rows, log) -> dict:
    """:func:`fit_partition_model` on one GPU's per-rank compute, then each model partition
    timed (the check: against the even split, and against the searched one where this run
    searched)."""
    model, table, info = fit_partition_model(args, world, ids_all, per_rank_ms, log)
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
    return dict(info, checks=checks,
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
    from llama_ane.cuda.runahead.prefill import HANDOFFS

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--name", help="stem of the JSON and the PNG (default runahead_gpu; "
                                   "runahead_cpu_dryrun with --cpu)")
    ap.add_argument("--world", type=int, help="GPUs (default: all); with one GPU, the ranks "
                                              "of the correctness checks and the estimate; "
                                              "with --cpu, processes (default 2)")
    ap.add_argument("--contexts", type=int, nargs="+",
                    help="default: 4096-32768 on one GPU, 8192-65536 on several, 512 1024 "
                         "with --cpu")
    ap.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS),
                    help="several GPUs: the rows to time (default: all)")
    ap.add_argument("--handoff", nargs="+", choices=HANDOFFS, default=list(HANDOFFS),
                    help="KV-Runahead's hand-offs to time and check (default: all; the first "
                         "is the checks' kvr and the search's)")
    ap.add_argument("--search", type=int, nargs="*",
                    help="contexts whose partition is searched (default: 8192 16384 32768 on "
                         "one GPU, none on several, where the model chooses)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--search-reps", type=int, default=1)
    ap.add_argument("--smollm2-dir", type=Path, help="folder with the SmolLM2 GGUF")
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument("--model-fit", type=int, nargs="*",
                    help="lengths of the rank cost model's fitting partitions (default: none on "
                         "one GPU, 8192 16384 on several, 512 1024 with --cpu)")
    ap.add_argument("--check-tokens", type=int,
                    help="prompt length of the random-weights logits check (default 4096; "
                         "256 a rank, at least 1024, with --cpu)")
    ap.add_argument("--skip-checks", action="store_true",
                    help="leave out the correctness checks (logits, SmolLM2)")
    ap.add_argument("--cpu", action="store_true",
                    help="dry run of the multi-GPU path: --world gloo processes on the CPU, a "
                         "tiny random Llama in fp32 (no GPU numbers)")
    args = ap.parse_args()

    import torch

    gpus = 0 if args.cpu else torch.cuda.device_count()
    if not args.cpu and not gpus:
        print("Error: benchmarks/runahead_gpu.py needs a CUDA GPU (or --cpu for a dry run)",
              file=sys.stderr)
        return 2
    if args.cpu and args.smollm2_dir:
        print("Error: the SmolLM2 check decodes with the GPU engine; on the CPU it is "
              "tests/test_runahead.py's", file=sys.stderr)
        return 2
    args.world = args.world or (2 if args.cpu else max(gpus, 2))
    several = args.cpu or gpus >= args.world >= 2
    if args.contexts is None:
        args.contexts = ([512, 1024] if args.cpu else [8192, 16384, 32768, 65536] if several
                         else [4096, 8192, 16384, 24576, 32768])
    if args.search is None:
        args.search = [] if several else [8192, 16384, 32768]
    if args.model_fit is None:
        args.model_fit = [512, 1024] if args.cpu else [8192, 16384] if several else []
    if "kvr_model" in args.methods and several and not args.model_fit:
        print("Error: kvr_model needs --model-fit lengths", file=sys.stderr)
        return 2
    args.check_tokens = args.check_tokens or (GRANULE * max(args.world, 4) if args.cpu else 4096)
    args.name = args.name or ("runahead_cpu_dryrun" if args.cpu else "runahead_gpu")
    lengths = args.contexts + args.search + args.model_fit + [args.check_tokens]
    if any(n % GRANULE or n < GRANULE * args.world for n in lengths):
        print(f"Error: contexts, fitting lengths and --check-tokens must be multiples of "
              f"{GRANULE}, at least {GRANULE} a rank", file=sys.stderr)
        return 2
    args.search = [n for n in args.search if n in args.contexts]
    args.handoff = list(dict.fromkeys(args.handoff))
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    started = time.time()
    report = dict(device="cpu" if args.cpu else torch.cuda.get_device_name(0), gpus=gpus,
                  world=args.world, torch=torch.__version__, contexts=args.contexts,
                  reps=args.reps, handoffs=args.handoff,
                  env={k: os.environ.get(k) for k in NCCL_ENV},
                  shapes="tiny Llama (random weights, fp32)" if args.cpu
                  else "Llama-3.1-8B (random weights, bf16)")
    if several:
        from llama_ane.cuda.runahead.launch import spawn

        report["mode"] = (f"CPU dry run: {args.world} processes, gloo; not a GPU measurement"
                          if args.cpu else f"{args.world} GPUs, one process each, NCCL")
        spawn(_rank_main, args.world, "gloo" if args.cpu else "nccl", (args,))
        parts = [json.loads((args.out_dir / f"{args.name}_rank{r}.json").read_text())
                 for r in range(args.world)]
        for r in range(args.world):
            (args.out_dir / f"{args.name}_rank{r}.json").unlink()
        # each check is reported by the rank holding the last token of each run
        for key in ("smollm2", "random_8b"):
            merged = {k: v for p in parts for k, v in (p.get(key) or {}).items()}
            report[key] = merged or None
        if "speed" in parts[0]:
            report["speed"] = parts[0]["speed"]
    else:
        report.update(one_gpu(args, lambda m: print(m, flush=True)))
    report["seconds"] = time.time() - started
    json_path = args.out_dir / f"{args.name}.json"
    json_path.write_text(json.dumps(report, indent=1) + "\n")
    rows = (report.get("speed") or {}).get("rows", [])
    if rows:
        plot(rows, args.out_dir / f"{args.name}.png",
             f"TTFT, {report['shapes'].split(' (')[0]}, {report['mode'].split(':')[0]} "
             f"({report['device']})")
        print("\n".join(summary(rows)))
    print(f"wrote {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
