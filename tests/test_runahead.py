"""KV-Runahead on the CPU: gloo process groups (one thread per rank, or one process per rank),
a tiny random Llama in fp32. The logits of every rank's slab equal one process's prefill, with
every hand-off and both sequence-parallel layouts, and the rank holding the last token has the
whole prompt's K/V. SmolLM2's greedy tokens after KV-Runahead equal those after one process's
prefill. Also the partition search, its lookup table and the cost model."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from llama_ane.cuda.runahead import partition
from llama_ane.cuda.runahead.launch import run_thread_ranks
from llama_ane.cuda.runahead.prefill import (HANDOFFS, Transport, greedy_after_prefill,
                                             runahead_prefill, sequence_parallel_prefill,
                                             single_prefill)


@pytest.fixture(scope="module")
def tiny():
    """(transformers model, CPU engine with 4-token pages): GQA 4/2, llama3 rope scaling."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from llama_ane.cuda.engine import GPUEngine

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      max_position_embeddings=256, initializer_range=0.1,
                      tie_word_embeddings=False,
                      rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 16})
    model = LlamaForCausalLM(cfg).eval()
    return model, GPUEngine(model, dtype=torch.float32, page_size=4, device="cpu")


def run_ranks(world: int, fn, handoff: str = "unbatched"):
    """``fn(transport)`` on ``world`` gloo ranks, one thread each; the results by rank."""
    return run_thread_ranks(world, fn, handoff=handoff, timeout_s=120)


def _tokens(cache, n):
    """K/V of the first ``n`` tokens of a paged cache: [layers, 2, n, Hkv, D]."""
    layers, pages, _, ps, hkv, d = cache.shape
    return cache.permute(0, 2, 1, 3, 4, 5).reshape(layers, 2, pages * ps, hkv, d)[:, :, :n]


def _prompt(n, seed=1):
    return torch.randint(0, 300, (n,), generator=torch.Generator().manual_seed(seed))


def _in_token_order(results):
    """Every rank's ``all_logits`` rows put back in token order by their spans."""
    rows = [(s, r.logits[i:i + e - s]) for r in results
            for s, e, i in _span_rows(r.spans)]
    return torch.cat([x for _, x in sorted(rows, key=lambda t: t[0])])


def _span_rows(spans):
    row = 0
    for s, e in spans:
        yield s, e, row
        row += e - s


@pytest.mark.parametrize("handoff", HANDOFFS)
@pytest.mark.parametrize("world,bounds", [(2, [0, 28, 45]), (4, [0, 16, 28, 36, 45]),
                                          (4, [0, 4, 8, 40, 45])])
def test_runahead_logits_equal_single_process_prefill(tiny, world, bounds, handoff):
    model, engine = tiny
    ids = _prompt(45)
    results = run_ranks(world, lambda t: runahead_prefill(engine, ids, bounds, t,
                                                          all_logits=True), handoff)
    assert [r.spans for r in results] == [[(lo, hi)] for lo, hi in zip(bounds, bounds[1:])]
    got = torch.cat([r.logits for r in results])
    want = engine.prefill_logits(ids.tolist())
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    with torch.no_grad():
        hf = model(ids[None]).logits[0]
    torch.testing.assert_close(got, hf, atol=1e-3, rtol=1e-3)
    # the last rank holds the K/V of the whole prompt, as one process would
    single = single_prefill(engine, ids)
    torch.testing.assert_close(_tokens(results[-1].cache, 45), _tokens(single.cache, 45))
    torch.testing.assert_close(results[-1].logits[-1], single.logits)


@pytest.mark.parametrize("layout", ["even", "zigzag"])
@pytest.mark.parametrize("world", [2, 4])
def test_sequence_parallel_logits_equal_single_process_prefill(tiny, world, layout):
    _, engine = tiny
    ids = _prompt(64, seed=2)
    results = run_ranks(world, lambda t: sequence_parallel_prefill(engine, ids, t, layout=layout,
                                                                   all_logits=True))
    assert [r.spans for r in results] == partition.sequence_parallel_spans(64, world, layout, 4)
    torch.testing.assert_close(_in_token_order(results), engine.prefill_logits(ids.tolist()),
                               atol=1e-4, rtol=1e-4)
    # the rank holding the last token (zigzag: rank 0) has the whole prompt's K/V
    holder = 0 if layout == "zigzag" else world - 1
    torch.testing.assert_close(_tokens(results[holder].cache, 64),
                               _tokens(single_prefill(engine, ids).cache, 64))
    first = run_ranks(world, lambda t: sequence_parallel_prefill(engine, ids, t, layout=layout))
    assert [r.logits is not None for r in first] == [r == holder for r in range(world)]
    torch.testing.assert_close(first[holder].logits, single_prefill(engine, ids).logits,
                               atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("world,n", [(2, 64), (4, 256), (3, 96)])
def test_zigzag_spans_balance_causal_attention(world, n):
    """Every token once; zigzag gives every rank the same query-key pairs, the even split
    does not."""
    def pairs(spans):
        return sum(t + 1 for s, e in spans for t in range(s, e))

    for layout in ("even", "zigzag"):
        spans = partition.sequence_parallel_spans(n, world, layout)
        assert sorted(t for r in spans for s, e in r for t in range(s, e)) == list(range(n))
        assert len({e - s for r in spans for s, e in r}) == 1
        work = [pairs(r) for r in spans]
        assert (len(set(work)) == 1) == (layout == "zigzag"), (layout, work)


def test_greedy_after_prefill_follows_the_plain_forward(tiny):
    """The check decode continues a prefill's cache as a plain causal forward over the growing
    prompt would."""
    _, engine = tiny
    ids = _prompt(23, seed=4).tolist()
    got = greedy_after_prefill(engine, single_prefill(engine, ids), len(ids), 6)
    want = list(ids)
    for _ in range(6):
        want.append(int(engine.prefill_logits(want)[-1].argmax()))
    assert got == want[len(ids):]


def test_bad_partitions_are_refused(tiny):
    _, engine = tiny
    ids = _prompt(45)
    with pytest.raises(ValueError, match="multiples of 4"):
        run_ranks(2, lambda t: runahead_prefill(engine, ids, [0, 30, 45], t))
    with pytest.raises(ValueError, match="2 entries"):
        runahead_prefill(engine, ids, [0, 32, 45])
    with pytest.raises(ValueError, match="at least one token"):
        partition.check_bounds([0, 20, 20, 45], 45, 3, 4)
    with pytest.raises(ValueError, match="3 entries"):
        partition.check_bounds([0, 45], 45, 2)
    with pytest.raises(ValueError, match="attention method"):
        runahead_prefill(engine, ids, [0, 45], method="flash")
    with pytest.raises(ValueError, match="divisible"):
        run_ranks(2, lambda t: sequence_parallel_prefill(engine, ids, t))
    with pytest.raises(ValueError, match="divisible by 8 chunks"):
        run_ranks(4, lambda t: sequence_parallel_prefill(engine, _prompt(48), t, layout="zigzag"))
    with pytest.raises(ValueError, match="layout"):
        partition.sequence_parallel_spans(48, 2, "ring")
    with pytest.raises(ValueError, match="hand-off"):
        run_ranks(2, lambda t: None, handoff="nccl")


def _rank_program(rank, world, engine, ids, bounds, out):
    """One process per rank (launch.spawn): the real torch.distributed default group of 4 ranks
    and a group of its first 2, every hand-off (``batched``: batch_isend_irecv), and the zigzag
    sequence-parallel baseline."""
    pair = dist.new_group([0, 1])
    pair_links = (dist.new_group([0, 1]), dist.new_group([0, 1]))
    for handoff in HANDOFFS:
        # new_group is collective: every process builds the links transport, then runs
        t4 = Transport(dist.group.WORLD, handoff=handoff)
        r = runahead_prefill(engine, ids, bounds[4], t4, all_logits=True)
        torch.save(r.logits, f"{out}/kvr4-{handoff}-{rank}.pt")
        if rank < 2:
            t2 = Transport(pair, handoff=handoff,
                           links=pair_links if handoff == "links" else None)
            r = runahead_prefill(engine, ids, bounds[2], t2, all_logits=True)
            torch.save(r.logits, f"{out}/kvr2-{handoff}-{rank}.pt")
    r = sequence_parallel_prefill(engine, ids[:32], Transport(dist.group.WORLD), layout="zigzag",
                                  all_logits=True)
    torch.save((r.spans, r.logits), f"{out}/sp4-zigzag-{rank}.pt")


@pytest.mark.slow  # a process per rank, each importing torch: ~60 s on a small CPU
def test_runahead_across_processes_with_gloo(tiny, tmp_path):
    from llama_ane.cuda.runahead.launch import spawn

    _, engine = tiny
    ids = _prompt(37, seed=3)
    bounds = {2: [0, 24, 37], 4: [0, 12, 20, 28, 37]}
    spawn(_rank_program, 4, "gloo", (engine, ids, bounds, str(tmp_path)))
    want = engine.prefill_logits(ids.tolist())
    for handoff in HANDOFFS:
        for world in (2, 4):
            got = torch.cat([torch.load(tmp_path / f"kvr{world}-{handoff}-{r}.pt")
                             for r in range(world)])
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4,
                                       msg=f"{world} ranks, {handoff}")
    sp = [torch.load(tmp_path / f"sp4-zigzag-{r}.pt") for r in range(4)]
    rows = sorted((s, logits[i:i + e - s]) for spans, logits in sp
                  for s, e, i in _span_rows(spans))
    torch.testing.assert_close(torch.cat([x for _, x in rows]),
                               engine.prefill_logits(ids[:32].tolist()), atol=1e-4, rtol=1e-4)


@pytest.mark.slow  # loads the embedded SmolLM2 GGUF (~40 s)
def test_smollm2_greedy_tokens_after_runahead_equal_one_process_prefill():
    """SmolLM2-135M, fp32 on the CPU, 2 gloo ranks: 16 greedy tokens after a KV-Runahead prefill
    of 320 tokens equal those after one process's prefill; every hand-off leaves the same cache
    and logits, bit for bit."""
    import importlib.resources

    from llama_ane.cuda.engine import GPUEngine, load_hf_model

    model, tok = load_hf_model()
    engine = GPUEngine(model, dtype=torch.float32, device="cpu")
    text = (importlib.resources.files("llama_ane") / "eval_text.txt").read_text()
    ids = tok(text)["input_ids"][:320]
    assert len(ids) == 320
    want = greedy_after_prefill(engine, single_prefill(engine, ids), len(ids), 16)
    last = {h: run_ranks(2, lambda t: runahead_prefill(engine, ids, [0, 176, 320], t), h)[-1]
            for h in HANDOFFS}
    got = greedy_after_prefill(engine, last["batched"], len(ids), 16)
    print("SmolLM2 after KV-Runahead:", tok.decode(got))
    assert got == want
    for handoff, res in last.items():
        assert torch.equal(res.cache, last["batched"].cache), handoff
        assert torch.equal(res.logits, last["batched"].logits), handoff


@pytest.mark.slow  # two processes, each importing torch and transformers
def test_benchmark_dry_run_on_the_cpu(tmp_path):
    """benchmarks/runahead_gpu.py's multi-GPU path on gloo processes: every baseline, with every
    hand-off, lands in the JSON, and the checks agree with one process."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "runahead_gpu.py"
    subprocess.run([sys.executable, str(script), "--cpu", "--world", "2", "--out-dir",
                    str(tmp_path), "--contexts", "1024", "--model-fit", "512", "1024",
                    "--reps", "1"], check=True, timeout=600)
    report = json.loads((tmp_path / "runahead_cpu_dryrun.json").read_text())
    assert report["mode"].startswith("CPU dry run") and report["env"]["NCCL_NVLS_ENABLE"] == "0"
    methods = {r["method"] for r in report["speed"]["rows"]}
    assert methods == {"single", "sequence_parallel", "sequence_parallel_zigzag",
                       *(f"kvr_{p}:{h}" for p in ("even", "model") for h in HANDOFFS)}
    for row in report["speed"]["rows"]:
        assert row["ttft_ms"] > 0 and len(row["per_rank_ms"]) == 2
    assert set(report["speed"]["models"]) == set(HANDOFFS)
    checks = report["random_8b"]
    for name in ("kvr", "kvr_batched", "kvr_links", "sp", "sp_zigzag"):
        assert checks[f"{name}_vs_single"]["rel_l2"] < 1e-5, name
    assert (tmp_path / "runahead_cpu_dryrun.png").exists()


# -- partition search and lookup table --------------------------------------------------------


def _bowl(target):
    """A cost with its minimum at ``target`` bounds (and a flat floor elsewhere)."""
    return lambda b: 1.0 + sum((x - t) ** 2 for x, t in zip(b, target)) * 1e-6


@pytest.mark.parametrize("context,world,target,granule", [
    (16384, 2, [0, 9728, 16384], 256),
    (96, 4, [0, 28, 70, 84, 96], 2),
    (4096, 3, [0, 1792, 3072, 4096], 64),
])
def test_grid_search_finds_the_best_partition(context, world, target, granule):
    seen = []
    result = partition.hierarchical_grid_search(context, world, _bowl(target), granule=granule,
                                                progress=seen.append)
    assert result.bounds == target
    assert result.seconds == pytest.approx(1.0)
    assert len(seen) == result.levels >= 2
    # a grid per level, not the whole space
    assert len(result.evaluated) <= result.levels * 5 ** (world - 1) + 1
    assert len(result.evaluated) < 0.2 * (context // granule) ** (world - 1)


def test_lookup_table_interpolates_between_searched_lengths(tmp_path):
    table = partition.PartitionTable()
    table.add([0, 4800, 8192])      # 8k: 0.5859 / 0.4141
    table.add([0, 9728, 16384])     # 16k: 0.59375 / 0.40625
    table.add([0, 3, 5, 7, 8])
    path = tmp_path / "table.json"
    table.save(path)
    loaded = partition.PartitionTable.load(path)
    fr = loaded.fractions(12288, 2)
    assert fr == pytest.approx([(4800 / 8192 + 9728 / 16384) / 2,
                                (3392 / 8192 + 6656 / 16384) / 2])
    bounds = loaded.predict(12288, 2, granule=256)
    assert bounds[0] == 0 and bounds[-1] == 12288 and bounds[1] % 256 == 0
    assert abs(bounds[1] - 12288 * fr[0]) <= 128
    # outside the table: the nearest entry's fractions; no entry for the world: the even split
    assert loaded.predict(32768, 2, 256) == [0, 19456, 32768]
    assert loaded.predict(1000, 3, 8) == partition.even_bounds(1000, 3, 8)
    assert loaded.predict(80, 4, 1) == [0, 30, 50, 70, 80]


# -- the partition cost model ---------------------------------------------------------------------

# a synthetic GPU: 2 ms fixed, 30 us a token, 1.3 ns per attended query-key pair, 1 us per
# prefix token received (seconds); shaped like the committed H100 one-GPU estimates
TRUE_COEF = (2e-3, 3e-5, 1.3e-9, 1e-6)


def _synthetic(world, coef=TRUE_COEF, noise=0.0, seed=0):
    """``timed(bounds)`` -> every rank's seconds under ``coef`` (relative noise ``noise``)."""
    import random

    rng = random.Random(seed)

    def timed(bounds):
        return [sum(c * f for c, f in zip(coef, partition.rank_features(lo, hi - lo)))
                * (1 + rng.uniform(-noise, noise)) for lo, hi in zip(bounds, bounds[1:])]
    return timed


def _brute_force(context, world, granule, cost):
    """The best partition over every granule-aligned choice (small worlds only)."""
    import itertools

    steps = range(granule, context, granule)
    best = None
    for inner in itertools.combinations(steps, world - 1):
        b = [0, *inner, context]
        c = cost(b)
        if best is None or c < best[0]:
            best = (c, b)
    return best


@pytest.mark.parametrize("world", [2, 3, 4])
def test_cost_model_fit_recovers_the_coefficients(world):
    timed = _synthetic(world, noise=0.01)
    parts = partition.fitting_partitions([8192, 16384], world, granule=256)
    assert len(parts) == 4  # a few timed points, not a search
    model = partition.fit_rank_cost_model([(b, timed(b)) for b in parts])
    assert model.world == world and model.samples == 4 * world
    # the per-token and attention terms carry the time (the 2 ms fixed cost is within the noise)
    for got, want in zip(model.coef[1:3], TRUE_COEF[1:3]):
        assert got == pytest.approx(want, rel=0.15)
    # its predictions hold at lengths it was not fitted on
    exact = _synthetic(world)
    for n in (4096, 32768, 65536):
        b = partition.even_bounds(n, world, 256)
        assert model.ranks(b) == pytest.approx(exact(b), rel=0.05)


@pytest.mark.parametrize("world,context,granule", [(2, 32768, 256), (3, 16384, 512),
                                                   (2, 65536, 1024), (4, 8192, 512)])
def test_cost_model_partition_is_the_best_partition(world, context, granule):
    """The model's partition is the true optimum (within a granule's worth of time), far better
    than the even split, and its slowest rank is what it predicted."""
    timed = _synthetic(world)
    model = partition.fit_rank_cost_model(
        [(b, timed(b)) for b in partition.fitting_partitions([4096, 16384], world, 256)])

    def truth(b):
        return max(timed(b))

    bounds = model.partition(context, granule)
    partition.check_bounds(bounds, context, world, granule)
    best_s, best = _brute_force(context, world, granule, truth)
    assert truth(bounds) <= best_s * 1.01, (bounds, best)
    even = partition.even_bounds(context, world, granule)
    assert truth(bounds) < 0.95 * truth(even)
    assert model.ttft(bounds) == pytest.approx(truth(bounds), rel=0.02)
    # KV-Runahead's shape: every later rank attends to more, so it takes fewer tokens
    slabs = [hi - lo for lo, hi in zip(bounds, bounds[1:])]
    assert slabs == sorted(slabs, reverse=True)


def test_cost_model_fills_the_table_and_checks_against_the_search(tmp_path):
    world, granule = 2, 256
    timed = _synthetic(world, noise=0.005, seed=3)
    model = partition.fit_rank_cost_model(
        [(b, timed(b)) for b in partition.fitting_partitions([8192, 16384], world, granule)])
    table = model.fill_table([8192, 16384, 32768, 65536], granule)
    assert sorted(table.entries[2]) == [8192, 16384, 32768, 65536]
    for n in (8192, 32768):
        assert table.predict(n, 2, granule) == model.partition(n, granule)
    table.save(tmp_path / "t.json")
    assert partition.PartitionTable.load(tmp_path / "t.json").entries == table.entries
    again = partition.RankCostModel.from_json(model.to_json())
    assert again == model
    # the measured search is the check: the model's partition is within 1% of what it finds,
    # and the fit timed fewer partitions (4, for every length) than the search at one length
    exact = _synthetic(world)
    check = partition.check_model_against_search(model, 32768, lambda b: max(exact(b)),
                                                 granule=granule)
    assert check["model_vs_search"] <= 1.01
    assert check["search_measured"] > 4


def test_cost_model_on_the_committed_h100_estimates():
    """Fitted to the even splits of the committed one-GPU H100 run (per-rank compute of 2
    ranks at 4k-32k, runahead_gpu.json), the model finds the searched partitions of that run:
    the same bound at 16k, within 4 granules at 32k."""
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "runahead_gpu.json"
    if not path.exists():
        pytest.skip("no committed KV-Runahead results")
    rows = json.loads(path.read_text())["speed"]["rows"]
    even = [(r["bounds"], [t / 1e3 for t in r["per_rank_compute_ms"]]) for r in rows
            if r["method"] == "kvr_even_estimate"]
    searched = {r["context"]: r["bounds"] for r in rows if r["method"] == "kvr_searched_estimate"}
    assert len(even) >= 3 and searched
    model = partition.fit_rank_cost_model(even)
    for n, bounds in searched.items():
        got = model.partition(n, 256)
        assert abs(got[1] - bounds[1]) <= 4 * 256, (n, got, bounds)


def test_cost_model_rejects_bad_samples():
    with pytest.raises(ValueError, match="ranks but"):
        partition.fit_rank_cost_model([([0, 10, 20], [1.0])])
    with pytest.raises(ValueError, match="at least"):
        partition.fit_rank_cost_model([([0, 10, 20], [1.0, 2.0])])
    with pytest.raises(ValueError, match="every sample"):
        partition.fit_rank_cost_model([([0, 10, 20], [1.0, 2.0]), ([0, 5, 10, 20], [1, 1, 1])])
