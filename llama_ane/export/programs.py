"""The MIL program of each exported model, built from its specs and its weights, and saved.

One program per package. On multifunction targets (iOS18, macOS15) it holds every function of the
model (prefill, decode, decode_branches, ...) and each weight is a const whose `weight_id` is its
parameter name, so the functions share one copy in the weight blob without any deduplication pass.
On older targets each function becomes a program of its own.

The graphs are written op for op like the torch modules in `llama_ane.chunks` (see mil_layers);
they are built in the export dtype and saved with no graph passes, so what is saved is what was
built. The mil executor runs them and `verify` compares them with the torch modules.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Callable

import numpy as np
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import Function, Program, types

from ..chunks.models import rope_tables
from ..config import LlamaConfig
from . import mil_layers as L
from ..contract.specs import BRANCHES, VERIFY, model_kind

_TYPES = {"float16": types.fp16, "float32": types.fp32, "int32": types.int32}


def _placeholders(io: dict) -> dict:
    """The function's inputs, then its states (read-write buffers of iOS18 programs)."""
    inputs = {t["name"]: mb.placeholder(shape=t["shape"], dtype=_TYPES[t["dtype"]]) for t in io["inputs"]}
    inputs.update({t["name"]: mb.state_tensor_placeholder(shape=t["shape"], dtype=_TYPES[t["dtype"]])
                   for t in io.get("states", [])})
    return inputs


def read_states(inputs: dict, io: dict) -> dict:
    """`inputs` with each state replaced by its value (read_state): what the body computes from."""
    return {**inputs, **{t["name"]: mb.read_state(input=inputs[t["name"]]) for t in io.get("states", [])}}


def write_window(states: dict, values: dict, new: dict, position, window: int) -> None:
    """Write a window's K/V into the cache states at `position` (chunks.models.write_window).

    states: the "k_cache"/"v_cache" state inputs; values: their values as read at the start
    (L,KV,1,T); new: "k_cache"/"v_cache" -> the window's (L,KV,1,S); position: int32 (1,). A slice
    update of columns [position, position + S), then the state is written back.
    """
    for name, state in states.items():
        layers, channels, one, _ = values[name].shape
        begin = mb.concat(values=[np.zeros(3, np.int32), position], axis=0)
        end = mb.add(x=begin, y=np.array([layers, channels, one, window], np.int32))
        mb.coreml_update_state(state=state, value=mb.slice_update(x=values[name], update=new[name],
                                                                   begin=begin, end=end))


def _named(var, name: str):
    """Give a function output the name the manifest uses for it."""
    var.name = name
    var.op.name = name
    return var


def _shape(io: dict, name: str, where: str = "inputs") -> list[int]:
    return next(t["shape"] for t in io[where] if t["name"] == name)


def lookup(g: L.Graph, input_ids, rows: tuple[int, int], vocab_size: int):
    """Embeddings of input_ids (1,S) from vocabulary rows [start, end) -> (1,C,1,S) (chunks.models.lookup):
    ids outside the rows are clamped into range and their lookup multiplied by 0."""
    table = g.weight("embed_tokens.weight")
    start, end = rows
    if start == 0 and end == vocab_size:
        found = mb.gather(x=table, indices=input_ids, axis=0)  # (1,S,C)
    else:
        local = mb.minimum(x=mb.maximum(x=mb.sub(x=input_ids, y=np.int32(start)), y=np.int32(0)),
                           y=np.int32(end - start - 1))
        hit = mb.logical_and(x=mb.greater_equal(x=input_ids, y=np.int32(start)), y=mb.less(x=input_ids, y=np.int32(end)))
        hit = mb.expand_dims(x=mb.cast(x=hit, dtype="fp16" if g.dtype == np.float16 else "fp32"), axes=[2])  # (1,S,1)
        found = mb.mul(x=mb.gather(x=table, indices=local, axis=0), y=hit)
    return mb.expand_dims(x=mb.transpose(x=found, perm=[0, 2, 1]), axes=[2])  # (1,S,C) -> (1,C,1,S)


def _bucket(io: dict, where: str = "inputs") -> int:
    """The cache positions a window function reads: its mask's columns less the window's own."""
    mask = _shape(io, "mask", where)
    return mask[3] - mask[2]


def embeddings_function(g: L.Graph, cfg: LlamaConfig, io: dict, rows: tuple[int, int]):
    """Token lookup, RoPE rows and the mask of one window (chunks.models.Embeddings), masking the
    cache positions of its context bucket."""
    def body(inputs):
        s = _shape(io, "input_ids")[1]
        t = _bucket(io, "outputs")
        hidden = lookup(g, inputs["input_ids"], rows, cfg.vocab_size)
        pos = mb.add(x=inputs["position"], y=np.arange(s, dtype=np.int32))  # (S,)
        cos, sin = (mb.reshape(x=mb.transpose(x=mb.gather(x=g.weight(name), indices=pos, axis=0), perm=[1, 0]),
                               shape=[1, cfg.head_dim, 1, s]) for name in ("cos_table", "sin_table"))
        cached = mb.less(x=np.arange(t, dtype=np.int32).reshape(1, 1, 1, t),
                         y=mb.reshape(x=inputs["position"], shape=[1, 1, 1, 1]))  # (1,1,1,T)
        cache_mask = L.mask_from(g, cached)
        if s > 1:
            cache_mask = mb.tile(x=cache_mask, reps=[1, 1, s, 1])
        window = g.const(np.triu(np.full((s, s), L.MASK_VALUE, np.float32), 1).reshape(1, 1, s, s), "window_mask")
        mask = mb.concat(values=[cache_mask, window], axis=3)
        return {"hidden_states": hidden, "cos": cos, "sin": sin, "mask": mask}
    return body


def branch_embeddings_function(g: L.Graph, cfg: LlamaConfig, io: dict, context_length: int, suffix_length: int,
                               rows: tuple[int, int]):
    """Token lookup, per-branch RoPE rows, prefix and suffix masks (chunks.cascade.BranchEmbeddings)."""
    def body(inputs):
        b = _shape(io, "input_ids")[1]
        t, u = context_length, suffix_length
        hidden = lookup(g, inputs["input_ids"], rows, cfg.vocab_size)
        cos, sin = (mb.reshape(x=mb.transpose(x=mb.gather(x=g.weight(name), indices=inputs["positions"], axis=0),
                                              perm=[1, 0]), shape=[1, cfg.head_dim, 1, b])
                    for name in ("cos_table", "sin_table"))
        plen = mb.reshape(x=inputs["prefix_length"], shape=[1, 1, 1, 1])
        prefix_mask = L.mask_from(g, mb.less(x=np.arange(t, dtype=np.int32).reshape(1, 1, 1, t), y=plen))
        filled = mb.reshape(x=mb.sub(x=inputs["positions"], y=inputs["prefix_length"]), shape=[1, b, 1, 1])
        in_suffix = mb.less(x=np.arange(u, dtype=np.int32).reshape(1, 1, 1, u), y=filled)  # (1,B,1,U)
        suffix_mask = mb.concat(values=[L.mask_from(g, in_suffix), g.const(np.zeros((1, b, 1, 1)), "self_column")],
                                axis=3)
        return {"hidden_states": hidden, "cos": cos, "sin": sin, "prefix_mask": prefix_mask,
                "suffix_mask": suffix_mask}
    return body


def verify_embeddings_function(g: L.Graph, cfg: LlamaConfig, io: dict, context_length: int, rows: tuple[int, int]):
    """Token lookup, RoPE rows at each tree token's position, cache + tree mask (chunks.verify.VerifyEmbeddings)."""
    def body(inputs):
        w = _shape(io, "input_ids")[1]
        t = context_length
        hidden = lookup(g, inputs["input_ids"], rows, cfg.vocab_size)
        pos = mb.add(x=inputs["position"], y=inputs["depths"])  # (W,)
        cos, sin = (mb.reshape(x=mb.transpose(x=mb.gather(x=g.weight(name), indices=pos, axis=0), perm=[1, 0]),
                               shape=[1, cfg.head_dim, 1, w]) for name in ("cos_table", "sin_table"))
        cached = mb.less(x=np.arange(t, dtype=np.int32).reshape(1, 1, 1, t),
                         y=mb.reshape(x=inputs["position"], shape=[1, 1, 1, 1]))  # (1,1,1,T)
        cache_mask = mb.tile(x=L.mask_from(g, cached), reps=[1, 1, w, 1])
        mask = mb.concat(values=[cache_mask, inputs["tree_mask"]], axis=3)
        return {"hidden_states": hidden, "cos": cos, "sin": sin, "mask": mask}
    return body


def embeddings_part_function(g: L.Graph, cfg: LlamaConfig, rows: tuple[int, int]):
    """A later embeddings file: the hidden states plus the lookup of its rows (chunks.models.EmbeddingsPart)."""
    def body(inputs):
        return {"hidden_states_out": mb.add(x=inputs["hidden_states"],
                                            y=lookup(g, inputs["input_ids"], rows, cfg.vocab_size))}
    return body


def chunk_function(g: L.Graph, cfg: LlamaConfig, io: dict, layers: int):
    """`layers` decoder layers over a window (chunks.models.BlockChunk), attending to the cache
    positions of its context bucket; when the caches are states (of the whole context: a bucket
    reads their first positions through static slices), the window's K/V is written into them at
    `position` instead of being returned."""
    def body(inputs):
        s, context_length = _shape(io, "hidden_states")[3], _bucket(io)
        values = read_states(inputs, io)
        x, ks, vs = inputs["hidden_states"], [], []
        for i in range(layers):
            x, k, v = L.decoder_layer(g, cfg, f"layers.{i}.", x, inputs["cos"], inputs["sin"], inputs["mask"],
                                      values["k_cache"], values["v_cache"], i, context_length, s)
            ks.append(k)
            vs.append(v)
        if io.get("states"):
            write_window({n: inputs[n] for n in ("k_cache", "v_cache")}, values,
                         {"k_cache": _stack(ks), "v_cache": _stack(vs)}, inputs["position"], s)
            return {"hidden_states_out": x}
        return {"hidden_states_out": x, "k_new": _stack(ks), "v_new": _stack(vs)}
    return body


def branch_chunk_function(g: L.Graph, cfg: LlamaConfig, io: dict, layers: int, context_length: int,
                          suffix_length: int):
    """`layers` decoder layers for B branches over a shared prefix (chunks.cascade.BranchChunk)."""
    def body(inputs):
        b = _shape(io, "hidden_states")[3]
        inputs = read_states(inputs, io)  # the prefix caches, read only
        x, ks, vs = inputs["hidden_states"], [], []
        for i in range(layers):
            x, k, v = L.branch_layer(g, cfg, f"layers.{i}.", x, inputs["cos"], inputs["sin"], inputs["prefix_mask"],
                                     inputs["suffix_mask"], inputs["k_cache"], inputs["v_cache"],
                                     inputs["k_suffix"], inputs["v_suffix"], i, context_length, b, suffix_length)
            ks.append(k)
            vs.append(v)
        return {"hidden_states_out": x, "k_new": _stack(ks), "v_new": _stack(vs)}
    return body


def _stack(vars_: list):
    return vars_[0] if len(vars_) == 1 else mb.concat(values=vars_, axis=0)


def lm_head_function(g: L.Graph, cfg: LlamaConfig, io: dict):
    """Final norm and the vocabulary projection split by rows (chunks.models.LMHead); output logits_j
    is vocabulary split j, whose weight is "heads.j.weight"."""
    def body(inputs):
        h = L.rms_norm(g, inputs["hidden_states"], "norm.weight", cfg.rms_norm_eps, cfg.hidden_size)
        return {t["name"]: L.conv(g, h, f"heads.{t['name'].removeprefix('logits_')}.weight") for t in io["outputs"]}
    return body


def cache_update_function(g: L.Graph, io: dict):
    """Write a window's K/V at position .. position+S-1 with a one-hot matmul (chunks.models.CacheUpdate),
    or, given `slots` (the "verify" update, chunks.verify.VerifyUpdate), token i's at slots[i] (none at -1)."""
    def body(inputs):
        t = _shape(io, "k_cache")[3]
        s = _shape(io, "k_new")[3]
        if "slots" in inputs:
            where = mb.reshape(x=inputs["slots"], shape=[s, 1])  # (S,1)
        else:
            where = mb.add(x=inputs["position"], y=np.arange(s, dtype=np.int32).reshape(s, 1))  # (S,1)
        onehot = mb.cast(x=mb.equal(x=np.arange(t, dtype=np.int32).reshape(1, t), y=where),
                         dtype="fp16" if g.dtype == np.float16 else "fp32")  # (S,T)
        keep = mb.sub(x=g.scalar(1.0), y=mb.reduce_sum(x=onehot, axes=[0], keep_dims=False))  # (T,)
        return {f"{n}_cache_out": mb.add(x=mb.mul(x=inputs[f"{n}_cache"], y=keep),
                                         y=mb.matmul(x=inputs[f"{n}_new"], y=onehot)) for n in ("k", "v")}
    return body


def suffix_update_function(g: L.Graph, cfg: LlamaConfig, io: dict):
    """Write each branch's new K/V into its own suffix slot (chunks.cascade.SuffixUpdate)."""
    def body(inputs):
        rows, b, d, u = _shape(io, "k_suffix")
        slot = mb.equal(x=np.arange(u, dtype=np.int32).reshape(1, 1, 1, u),
                        y=mb.reshape(x=inputs["suffix_positions"], shape=[1, b, 1, 1]))  # (1,B,1,U)
        out = {}
        for n in ("k", "v"):
            new = mb.expand_dims(x=mb.transpose(x=mb.reshape(x=inputs[f"{n}_new"], shape=[rows, d, b]), perm=[0, 2, 1]),
                                 axes=[3])  # (L*G,B,D,1)
            out[f"{n}_suffix_out"] = mb.select(cond=slot, a=new, b=inputs[f"{n}_suffix"])
        return out
    return body


def function_body(model: str, function: str, g: L.Graph, cfg: LlamaConfig, io: dict, *, layers: int,
                  context_length: int, suffix_length: int, rows: tuple[int, int] | None = None):
    """The builder of one (model, function) of the export; `rows` are the vocabulary rows of an
    embeddings file."""
    kind = model_kind(model)
    if kind == "embeddings":
        if function == BRANCHES:
            return branch_embeddings_function(g, cfg, io, context_length, suffix_length, rows)
        if function == VERIFY:
            return verify_embeddings_function(g, cfg, io, context_length, rows)
        return embeddings_function(g, cfg, io, rows)
    if kind == "embeddings_part":
        return embeddings_part_function(g, cfg, rows)
    if kind == "lm_head":
        return lm_head_function(g, cfg, io)
    if kind == "cache_update":
        return (suffix_update_function(g, cfg, io) if function.startswith(BRANCHES)
                else cache_update_function(g, io))
    if function == BRANCHES:
        return branch_chunk_function(g, cfg, io, layers, context_length, suffix_length)
    return chunk_function(g, cfg, io, layers)


def build_program(model: str, functions: dict[str, dict], cfg: LlamaConfig, weights: L.Weights, *, dtype: type,
                  opset, layers: int, context_length: int, suffix_length: int,
                  rows: tuple[int, int] | None = None, compressions=lambda name: None,
                  importance=lambda name: None, multifunction: bool = True) -> Program:
    """A Program with one function per entry of `functions` ({function: io spec}) of `model`
    (without `multifunction`, its one function is "main", the name single-function packages use);
    `compressions(name)` gives the Compression of a parameter (None: dense), `importance(name)` the
    weights of its input channels in a LUT fit (None: equal)."""
    import coremltools as ct

    if not multifunction and len(functions) != 1:
        raise ValueError(f"a single-function package holds one function, not {list(functions)}")
    g = L.Graph(dtype, weights, compressions, ios18=opset >= ct.target.iOS18, importance=importance)
    prog = Program()
    for fn, io in functions.items():
        body = function_body(model, fn, g, cfg, io, layers=layers, context_length=context_length,
                             suffix_length=suffix_length, rows=rows)
        with Function(_placeholders(io), opset_version=opset) as func:
            outs = body(func.inputs)
            func.set_outputs([_named(outs[t["name"]], t["name"]) for t in io["outputs"]])
        prog.add_function(fn if multifunction else "main", func)
    prog.default_function_name = list(functions)[-1] if multifunction else "main"
    return prog


def save_program(prog: Program, path: Path, specification_version: int, multifunction: bool) -> None:
    """Serialize `prog` as an .mlpackage at `path`, with no graph passes, written in place.

    coremltools writes the weight blob to a temporary folder and copies it into the package; the
    caller points `tempfile.tempdir` into the export's own partial folder so nothing is left in /tmp.
    """
    import coremltools as ct
    from coremltools.converters.mil.converter import mil_convert

    prog.skip_all_passes = True
    prog.export_as_multifunction = multifunction
    with _no_pass_pipelines():
        mil_convert(prog, convert_from="milinternal", convert_to="mlprogram",
                    specification_version=specification_version, compute_units=ct.ComputeUnit.CPU_ONLY,
                    skip_model_load=True, package_dir=os.fspath(path))
    make_reproducible(path)


def make_reproducible(path: Path) -> None:
    """Rewrite what coremltools saves differently on every run, so one input gives one hash: the
    model spec's protobuf maps are serialized in a fixed order, and the package's item identifiers
    (random UUIDs) are derived from the item paths."""
    import json
    import uuid

    from coremltools.proto import Model_pb2

    spec_file = path / "Data" / "com.apple.CoreML" / "model.mlmodel"
    spec = Model_pb2.Model.FromString(spec_file.read_bytes())
    spec_file.write_bytes(spec.SerializeToString(deterministic=True))
    manifest_file = path / "Manifest.json"
    manifest = json.loads(manifest_file.read_text())
    ids = {old: str(uuid.uuid5(uuid.NAMESPACE_URL, f"llama-ane:{entry['path']}")).upper()
           for old, entry in manifest["itemInfoEntries"].items()}
    manifest["itemInfoEntries"] = {ids[k]: v for k, v in sorted(manifest["itemInfoEntries"].items(),
                                                                  key=lambda kv: ids[kv[0]])}
    manifest["rootModelIdentifier"] = ids[manifest["rootModelIdentifier"]]
    manifest_file.write_text(json.dumps(manifest, indent=4, sort_keys=True) + "\n")


@contextlib.contextmanager
def _no_pass_pipelines():
    """Skip coremltools' pass pipelines: with every pass skipped they would still validate the whole
    program after each of ~100 passes (most of the time of saving a 30-layer chunk). The program is
    still validated once, when it is serialized."""
    from coremltools.converters.mil.mil.passes.pass_pipeline import PassPipelineManager

    real = PassPipelineManager.apply_pipeline
    PassPipelineManager.apply_pipeline = staticmethod(lambda prog, pipeline: None)
    try:
        yield
    finally:
        PassPipelineManager.apply_pipeline = staticmethod(real)


def rope_weights(cfg: LlamaConfig, positions: int, dtype: type) -> dict[str, np.ndarray]:
    """cos/sin tables (positions, D) in fp32, stored in the export dtype (fp16 cannot compute them)."""
    cos, sin = rope_tables(cfg, positions)
    return {"cos_table": cos.numpy().astype(dtype), "sin_table": sin.numpy().astype(dtype)}


__all__ = ["build_program", "save_program", "make_reproducible", "rope_weights"]
