"""KV-Runahead on the CPU: gloo process groups (one thread per rank, or one process per rank),
a tiny random Llama in fp32. The logits of every rank's slab equal one process's prefill, and the
last rank's cache holds the whole prompt's K/V. Also the partition search and its lookup table."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from llama_ane.cuda.runahead import partition
from llama_ane.cuda.runahead.launch import run_thread_ranks
from llama_ane.cuda.runahead.prefill import (Transport, runahead_prefill,
                                             sequence_parallel_prefill, single_prefill)


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


def run_ranks(world: int, fn):
    """``fn(transport)`` on ``world`` gloo ranks, one thread each; the results by rank."""
    return run_thread_ranks(world, fn, timeout_s=120)


def _tokens(cache, n):
    """K/V of the first ``n`` tokens of a paged cache: [layers, 2, n, Hkv, D]."""
    layers, pages, _, ps, hkv, d = cache.shape
    return cache.permute(0, 2, 1, 3, 4, 5).reshape(layers, 2, pages * ps, hkv, d)[:, :, :n]


def _prompt(n, seed=1):
    return torch.randint(0, 300, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("world,bounds", [(2, [0, 28, 45]), (4, [0, 16, 28, 36, 45]),
                                          (4, [0, 4, 8, 40, 45])])
def test_runahead_logits_equal_single_process_prefill(tiny, world, bounds):
    model, engine = tiny
    ids = _prompt(45)
    results = run_ranks(world, lambda t: runahead_prefill(engine, ids, bounds, t,
                                                          all_logits=True))
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


@pytest.mark.parametrize("world", [2, 4])
def test_sequence_parallel_logits_equal_single_process_prefill(tiny, world):
    _, engine = tiny
    ids = _prompt(48, seed=2)
    results = run_ranks(world, lambda t: sequence_parallel_prefill(engine, ids, t,
                                                                   all_logits=True))
    torch.testing.assert_close(torch.cat([r.logits for r in results]),
                               engine.prefill_logits(ids.tolist()), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(_tokens(results[-1].cache, 48),
                               _tokens(single_prefill(engine, ids).cache, 48))


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


def _rank_program(rank, world, engine, ids, bounds, out):
    """One process per rank (launch.spawn): the real torch.distributed default group."""
    result = runahead_prefill(engine, ids, bounds, Transport(dist.group.WORLD), all_logits=True)
    torch.save(result.logits, f"{out}/rank{rank}.pt")


@pytest.mark.slow  # a process per rank, each importing torch: ~50 s on a small CPU
def test_runahead_across_processes_with_gloo(tiny, tmp_path):
    from llama_ane.cuda.runahead.launch import spawn

    _, engine = tiny
    ids = _prompt(37, seed=3)
    spawn(_rank_program, 2, "gloo", (engine, ids, [0, 24, 37], str(tmp_path)))
    got = torch.cat([torch.load(tmp_path / f"rank{r}.pt") for r in range(2)])
    torch.testing.assert_close(got, engine.prefill_logits(ids.tolist()), atol=1e-4, rtol=1e-4)


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
