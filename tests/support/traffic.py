"""The device cost model's tiny planned manifests and the byte sums the traffic tests hold them to, each
summed from the manifest's own tensor specs (what a step's functions read and write), never from the
code under test; and `llama-ane info`'s output."""

from __future__ import annotations

import math

from click.testing import CliRunner

from llama_ane.cli import main
from llama_ane.config import LlamaConfig
from llama_ane.contract import device_model as dm
from llama_ane.testing import TINY_CONFIG

from support.families import CASES

# the tiny_export fixture's shapes: 5 layers, 2 kv heads x 32, hidden 64, in chunks of 2 layers
TINY = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=5, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=32, max_position_embeddings=4096)
CTX = 256
ITEM = {"float16": 2, "float32": 4, "int32": 4}
# KV-shared layers 2 and 3 (chunk_1) reading layers 0 (sliding, a ring of 1 x 32 channels) and 1 (global,
# a cache of 1 x 64) in chunk_0: the two kinds' widths differ, as E2B's do (256 and 512)
KV_SHARED_WIDE = dict(TINY_CONFIG, vocab_size=320, **CASES["gemma4_kv_shared"], num_key_value_heads=1)


def nbytes(spec: dict) -> int:
    return math.prod(spec["shape"]) * ITEM[spec["dtype"]]


def is_cache(name: str) -> bool:
    """A chunk's cache input, its own or (shared_...) a producer's: k_cache, v_ring, shared_k_cache,
    k_ring_suffix, shared_v_suffix, ... (not the new K/V of the step, shared_k_new)."""
    return name.endswith(("_cache", "_ring", "_suffix"))


def cache_inputs(m: dict, fn: str, shared: bool | None = None) -> list[dict]:
    """The caches the chunks' `fn` functions take (`shared`: only KV-shared ones, or only their own)."""
    return [t for c in m["chunks"] for t in m["models"][c["model"]]["functions"][fn]["inputs"]
            if is_cache(t["name"]) and (shared is None or t["name"].startswith("shared_") == shared)]


def chunk_tensors(m: dict, fn: str, kind: str, names: tuple[str, ...]) -> list[dict]:
    """The chunks' `fn` tensors of `kind` ("inputs", "outputs", "states") called one of `names`."""
    return [t for c in m["chunks"] for t in m["models"][c["model"]]["functions"][fn].get(kind, [])
            if t["name"] in names]


def every_tensor(m: dict, fn: str) -> int:
    """Bytes of every input and output of a step's functions: embeddings files, chunks, LM head files
    (the later embeddings files and the heads run their plain function in every bucket)."""
    models = [*m["embeddings"]["models"], *(c["model"] for c in m["chunks"]), *m["lm_head"]["models"]]
    total = 0
    for model in models:
        functions = m["models"][model]["functions"]
        spec = functions.get(fn) or functions[fn.split("_")[0]]
        total += sum(nbytes(t) for t in spec["inputs"] + spec["outputs"])
    return total


def tiny(case: dict = KV_SHARED_WIDE, **options) -> dict:
    """The planned manifest of the config `case` at CTX: input caches, decode functions, a verify window, a cascade."""
    options = {"context_length": CTX, "prefill_length": 64, "layers_per_chunk": 2, "kv_cache": "inputs",
               "verify_window": 8, "branch_width": 2, "suffix_length": 32, "fold_lm_head": "no",
               "decode_function": "decode", **options}
    return dm.manifest_from_config(LlamaConfig.from_hf_dict(case), **options)


def dense_params(m: dict) -> float:
    """Weights a step reads (decompressed): the chunks, the LM head files and an embedding row, and
    with per-layer inputs (one embeddings file here) a row of L x P and the projection (and its norm)."""
    c = m["config"]
    stepped = [x["model"] for x in m["chunks"]] + m["lm_head"]["models"]
    per_layer = c["num_hidden_layers"] * (c.get("per_layer_input_size") or 0)
    assert not per_layer or len(m["embeddings"]["models"]) == 1
    table = per_layer + c["hidden_size"] * per_layer + (c.get("per_layer_input_size") or 0)
    return sum(m["weights"][x]["dense_bytes"] for x in stepped) / 2 + c["hidden_size"] + table


def run_info(*args) -> str:
    """What `llama-ane info ARGS` prints."""
    r = CliRunner().invoke(main, ["info", *map(str, args)], catch_exceptions=False)
    assert r.exit_code == 0, r.stderr
    return r.stdout
