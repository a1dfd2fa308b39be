"""The device cost model on Qwen3.5's linear-attention layers (contract/traffic.py,
contract/device_model.py and `llama-ane info`): their recurrent states (delta_state, a cascade's
delta_branches) are cache reads and their writes (delta_new, or the state) cache updates, and their
delta rule's flops are the matmuls the program runs, with no attention flops.

Expected bytes are summed from the manifest's own tensor specs by name; expected flops from the
config's shapes, the attention layers' mask widths and the matmuls torch's flop counter sees the
program (model/layers/delta_net.py's gated_delta) run at those shapes, never from the code under test."""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from llama_ane.contract import device_model as dm
from llama_ane.contract.traffic import decode_step_traffic, kv_read_bytes, kv_write_bytes, window_io_bytes
from llama_ane.model.layers.delta_net import gated_delta
from llama_ane.testing import TINY_CONFIG

from support.families import CASES
from support.traffic import CTX, cache_inputs, chunk_tensors, dense_params, every_tensor, nbytes, run_info, tiny

# layers 0, 2, 3 linear (chunk_1 of linear layers only), 1 attention; 2 key heads, 4 value heads of 16 x 32
QWEN35 = dict(TINY_CONFIG, vocab_size=320, **CASES["qwen35_tied_gqa"])
KV = ("k_cache", "v_cache")
CONV = ("conv_state", "conv_branches")
DELTA = ("delta_state", "delta_branches")
FUNCTIONS = ("prefill", "decode", "decode_branches")


def qwen35(kind: str = "inputs", **options) -> dict:
    return tiny(QWEN35, verify_window=0, kv_cache=kind, **options)  # linear layers cannot go back: no verify


def states(m: dict, fn: str, names: tuple[str, ...]) -> list[dict]:
    """The chunks' `fn` tensors called one of `names`, inputs or states."""
    return chunk_tensors(m, fn, "inputs", names) + chunk_tensors(m, fn, "states", names)


# ---- the bytes a step moves ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["inputs", "state"])
@pytest.mark.parametrize("fn", FUNCTIONS)
def test_a_step_reads_the_recurrent_states_and_writes_them(fn, kind):
    """Every chunk reads its recurrent state whole (delta_state, an input or a state, or a cascade's
    delta_branches) and writes it whole, once: its delta_new output with input caches and in a
    cascade step, else the state itself. The K/V and the conv states are counted as before."""
    m = qwen35(kind)
    tokens = dm.window_tokens(m, fn)
    delta = states(m, fn, DELTA)
    assert [t["shape"][0] for t in delta] == ([2, 4] if fn == "decode_branches" else [1, 2])  # L_d (x B) per chunk
    assert all(t["shape"][1:] == [4 * 16, 1, 32] for t in delta)
    delta_new = chunk_tensors(m, fn, "outputs", ("delta_new",))
    assert bool(delta_new) == (kind == "inputs" or fn == "decode_branches")
    written = delta_new or chunk_tensors(m, fn, "states", ("delta_state",))
    conv, conv_new = states(m, fn, CONV), chunk_tensors(m, fn, "outputs", ("conv_new",))
    branches = fn == "decode_branches"
    kv = states(m, fn, KV) + (chunk_tensors(m, fn, "inputs", ("k_suffix", "v_suffix")) if branches else [])
    assert kv_read_bytes(m, CTX, fn) == sum(nbytes(t) for t in kv + conv + delta)
    if branches:
        kv_write = 2 * sum(nbytes(t) for t in chunk_tensors(m, fn, "inputs", ("k_suffix", "v_suffix")))
    elif kind == "inputs":
        kv_write = 2 * sum(nbytes(t) for t in kv)
    else:
        kv_write = sum(nbytes(t) // CTX * tokens for t in kv)
    conv_write = (2 * sum(nbytes(t) for t in conv) if kind == "state" and not branches
                  else sum(nbytes(t) for t in conv_new))
    delta_write = sum(nbytes(t) for t in written)
    assert delta_write == sum(nbytes(t) for t in delta) > 0
    assert kv_write_bytes(m, CTX, fn) == kv_write + conv_write + delta_write


@pytest.mark.parametrize("fn", FUNCTIONS)
def test_a_step_moves_every_tensor_its_functions_pass(fn):
    """With input caches a step reads the weights and every input and output of its functions once
    (the recurrent states and delta_new among them, now cache traffic rather than window I/O), and
    the cache update reads and rewrites the attention layers' K/V: step totals as before."""
    m = qwen35()
    ctx = m["context_length"]
    step = dm.step_cost(m, fn, ctx - dm.window_tokens(m, fn) if fn != "decode_branches" else ctx)
    own = [s for s in cache_inputs(m, fn) if fn != "decode_branches" or s["name"].endswith("_suffix")]
    assert step.bytes == dm.weight_read_bytes(m) + every_tensor(m, fn) + 2 * sum(nbytes(s) for s in own)
    moved = (cache_inputs(m, fn) + states(m, fn, CONV + DELTA)
             + chunk_tensors(m, fn, "outputs", ("conv_new", "delta_new")))
    assert window_io_bytes(m, fn) == every_tensor(m, fn) - sum(nbytes(s) for s in moved)


def test_the_recurrent_states_other_kind_is_the_other_exports():
    """`info`'s alternative: an export's step priced with the other --kv-cache is what the export
    with that kind moves, recurrent states included."""
    inputs, state = qwen35("inputs"), qwen35("state")
    for filled in (0, 100, CTX - 1):
        assert decode_step_traffic(inputs, "state", filled=filled) == decode_step_traffic(state, filled=filled)
        assert decode_step_traffic(state, "inputs", filled=filled) == decode_step_traffic(inputs, filled=filled)
    # a state export reads its recurrent states whole and writes them whole, as an input-cache export does
    delta = sum(nbytes(s) for s in states(state, "decode", DELTA))
    others = sum(nbytes(s) for s in states(state, "decode", KV + CONV))
    assert decode_step_traffic(state).cache_read == others + delta == decode_step_traffic(inputs).cache_read


# ---- the flops -------------------------------------------------------------------------------------------------------

def counted_delta_flops(heads: int, k_heads: int, dk: int, dv: int, s: int, sequences: int = 1) -> int:
    """Flops torch's counter sees gated_delta run (its matmuls, 2 per multiply-add) over a window
    of `s` tokens, each of `sequences` sequences (a cascade's branches: the key heads batched)."""
    r, g = heads // k_heads, k_heads * sequences
    q, k = torch.randn(g, 1, dk, s), torch.randn(g, 1, dk, s)
    v, decay, beta = torch.randn(g, r, dv, s), -torch.rand(g, r, 1, s), torch.rand(g, r, 1, s)
    with FlopCounterMode(display=False) as counter:
        gated_delta(q, k, v, decay, beta, torch.randn(g, r, dk, dv))
    return counter.get_total_flops()


@pytest.mark.parametrize("kind", ["inputs", "state"])
@pytest.mark.parametrize("fn", FUNCTIONS)
def test_the_delta_rules_flops_are_the_programs(fn, kind):
    """A step's flops: 2 per weight per token, the attention layer's 4 per query channel per key
    (the width of its mask), none for the linear layers, and each linear layer's delta rule as
    the program runs it over the window (a prefill window's S x S matmuls and squarings), each
    cascade branch one token from its own state."""
    m = qwen35(kind)
    c = m["config"]
    tokens = dm.window_tokens(m, fn)
    masks = {t["name"]: t["shape"][-1] for t in m["models"]["embeddings"]["functions"][fn]["outputs"]}
    keys = masks["prefix_mask"] + m["suffix_length"] if fn == "decode_branches" else masks["mask"]
    linear = [n for n, kind_ in enumerate(QWEN35["layer_types"]) if kind_ == "linear_attention"]
    assert c["delta_layers"] == linear == m["cache"]["delta"]["layers"] == [0, 2, 3]
    attention = 4 * sum(c["num_attention_heads"] * c["head_dim"] * keys
                        for n in range(c["num_hidden_layers"]) if n not in linear)
    shape = (QWEN35["linear_num_value_heads"], QWEN35["linear_num_key_heads"], QWEN35["linear_key_head_dim"],
             QWEN35["linear_value_head_dim"])
    per_layer = (counted_delta_flops(*shape, 1, sequences=tokens) if fn == "decode_branches"
                 else counted_delta_flops(*shape, tokens))
    assert dm.delta_flops(m, fn) == len(linear) * per_layer
    step = dm.step_cost(m, fn, CTX - tokens if fn != "decode_branches" else CTX)
    assert step.flops == pytest.approx(tokens * (2 * dense_params(m) + attention) + len(linear) * per_layer)
    assert [k for n, k in enumerate(dm.attention_keys(m, CTX, 1)) if n in linear] == [0, 0, 0]


def test_a_decode_step_costs_a_few_state_sizes_a_layer():
    """Decoding, a linear layer's delta rule is about 3 multiply-adds per state element (the state
    read against k and against q, and k u^T added to it): H*Dk*Dv is the unit. A prefill window
    grows with S^3 log2 S, so 64 tokens cost far more than 64 decode steps' delta rule."""
    m = qwen35()
    state = 4 * 16 * 32
    per_layer = dm.delta_flops(m, "decode") / 3
    assert 6 * state <= per_layer <= 8 * state
    assert dm.delta_flops(m, "prefill") > 64 * dm.delta_flops(m, "decode")
    assert dm.delta_flops(tiny(dict(TINY_CONFIG, vocab_size=320, **CASES["lfm2_tied_gqa"]), verify_window=0),
                          "prefill") == 0


# ---- llama-ane info --------------------------------------------------------------------------------------------------

def test_info_shows_the_recurrent_states(tmp_path):
    """The linear layers' states, their bytes from the config's shapes, and the step's reads and
    writes of them; --json's other-kind pricing is the other export's."""
    (tmp_path / "q.json").write_text(json.dumps(QWEN35))
    out = run_info("--config", tmp_path / "q.json", "--context-length", CTX, "--kv-cache", "inputs", "--chip", "M4")
    recurrent, conv = 3 * 4 * 16 * 32 * 2, 3 * (2 * 2 * 16 + 4 * 32) * 32 * 2  # conv state 32 columns wide
    assert (f"  linear    layers [0, 2, 3] (Gated DeltaNet, 2 key / 4 value heads) keep a recurrent state of "
            f"4 x 16 x 32 each: {recurrent / 1e6:.2f} MB, with the conv states' {conv / 1e6:.2f} MB") in out
    assert "read and written, the recurrent states whole" in out
    got = json.loads(run_info("--config", tmp_path / "q.json", "--context-length", CTX, "--decode-function", "decode",
                              "--kv-cache", "inputs",
                              "--chip", "M4", "--json"))
    other = got["decode_step_bytes_other_kv_cache"]
    assert other["kv_cache"] == "state"
    m = tiny(QWEN35, verify_window=0, kv_cache="state", prefill_length=got["prefill_length"],
             layers_per_chunk=len(got["chunks"][0]["layers"]), branch_width=got["branch_width"],
             suffix_length=got["suffix_length"], fold_lm_head="auto" if got["lm_head"].get("folded_into") else "no")
    assert {k: other[k] for k in ("cache_read", "cache_update")} == {
        k: decode_step_traffic(m, filled=CTX - 1).to_dict()[k] for k in ("cache_read", "cache_update")}


@pytest.mark.export
@pytest.mark.parametrize("kind", ["inputs", "state"])
def test_an_exports_traffic(tmp_path, kind):
    """A real export's manifest: the same specs and cost as planned."""
    from llama_ane.api import export_model
    from llama_ane.contract.manifest import read_manifest

    from support.families import make_family_checkpoint

    folder = make_family_checkpoint(tmp_path / "ckpt", **QWEN35)
    out = export_model(folder, tmp_path / "out", context_length=CTX, prefill_length=64, layers_per_chunk=2,
                       kv_cache=kind, verify_window=0, branch_width=2, suffix_length=32, fold_lm_head="no",
                       decode_function="decode", progress=False, verify=False)
    m = read_manifest(out)

    def specs(manifest: dict) -> dict:
        return {(model, fn): (spec["inputs"], spec["outputs"], spec.get("states"))
                for model, entry in manifest["models"].items() for fn, spec in entry["functions"].items()}
    planned = qwen35(kind)
    assert specs(m) == specs(planned)
    for fn in FUNCTIONS:
        assert dm.step_cost(m, fn, 100) == dm.step_cost(planned, fn, 100)
    assert decode_step_traffic(m).cache_read == sum(nbytes(s) for s in states(m, "decode", KV + CONV + DELTA))
