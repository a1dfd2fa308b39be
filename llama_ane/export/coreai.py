"""Core AI (`.aimodel`) assets from the export plan: `llama-ane export --target coreai`.

The same `ExportPlan` that lays out the Core ML packages lays out the assets: one `.aimodel` per
manifest model (embeddings, block chunks, LM head, cache update), each with the functions the
manifest names (a prefill and a decode function per context bucket, and the cascade ones where
asked), their inputs and outputs named and shaped as the manifest declares them. Each function is
the project's torch reference module of that model (the modules the parity gate compares against),
exported with `torch.export` and converted by coreai-torch; LUT compression is coreai-opt's
k-means palettization of the converted program. Caches are function inputs and outputs, written
back by the cache-update model (`--kv-cache inputs`), or Core AI states (`--kv-cache state`): each
window function reads its chunk's states and writes the window into them (`StateFunction`), which
coreai-torch turns into state handles (a torch input mutated in place becomes a state).

The modules come from the caller (`modules_of`): they are built by the runtime's reference code,
which this layer does not import.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path
from typing import Any, Callable

import torch

from ..contract.options import COREAI_INSTALL_HINT
from ..contract.plan import ExportPlan, PackageSpec
from ..errors import LlamaANEError
from ..model import names as N
from ..model.cache_update import onehot_write, window_slots
from ..model.layers.delta_net import DELTA_STATE
from ..model.functions import RING_CACHES, WINDOW_TOKENS, shape_of
from ..model.layers.short_conv import conv_state_after
from ..quantize import Compression

# A weight smaller than this many elements stays dense (norm scales; coreai-opt's own default).
MIN_PALETTIZED_WEIGHTS = 1024


class CoreAIError(LlamaANEError, RuntimeError):
    """The Core AI packages are missing, or coreai-torch could not convert a model."""


def coreai_torch() -> Any:
    """The coreai-torch module; CoreAIError naming the extra where it is not installed."""
    try:
        import coreai_torch as ct
        import coreai.authoring.asset  # noqa: F401 (the asset writer the converter uses)
    except ImportError as e:
        raise CoreAIError(f"--target coreai needs the Python package {e.name or e}: {COREAI_INSTALL_HINT}") from None
    return ct


def example_inputs(io: dict, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Zeros of each input's (and state's) manifest shape: int32 for token ids and positions, `dtype`
    otherwise. The programs have static shapes, so any values trace the same graph."""
    return {t["name"]: torch.zeros(t["shape"], dtype=torch.int32 if t["dtype"] == "int32" else dtype)
            for t in io["inputs"] + io.get("states", [])}


class StateFunction(torch.nn.Module):
    """A chunk function whose caches are states (`--kv-cache state`), as a torch module coreai-torch
    converts into one with Core AI states: it takes the manifest's inputs, then its states,
    positionally, and mutates the states in place (a mutated input becomes a state).

    `module` (the function's reference module: BlockChunk, BranchChunk, or either carrying the LM
    head) runs on the states as the cache inputs it reads: a window function reads the first
    `bucket` positions of the full caches (one state of the whole context serves every bucket),
    the ring, the conv state and Qwen3.5's recurrent state (delta_state) whole. A window function's
    module returns the manifest's outputs, then each state's new values (`CACHES`, in the states'
    order), which are written back: the window's K/V at `position` in a full cache (a slice
    update), at the slots (position + s) mod R in the ring (a one-hot write), the conv state after
    the window's `window_tokens` real tokens, and the recurrent state as the module returns it
    (delta_new: already the state after the real tokens, so the module takes `window_tokens`
    too). The cascade's function only reads the prefix's states; since coreai-torch makes a
    state only of an input that is written, it writes each state's first column back unchanged.
    Returns the manifest's outputs.
    """

    def __init__(self, module: torch.nn.Module, io: dict):
        super().__init__()
        self.module = module
        self.inputs = [t["name"] for t in io["inputs"]]
        self.states = [t["name"] for t in io["states"]]
        self.outputs = len(io["outputs"])
        self.writes = N.POSITION in self.inputs  # the single-sequence windows; the cascade reads only
        mask = shape_of(io, N.MASK) if self.writes else None
        self.bucket = mask[3] - mask[2] if mask else None
        self.window = shape_of(io, N.HIDDEN_STATES)[3]

    def forward(self, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        named = dict(zip(self.inputs + self.states, args))
        position, tokens = named.pop(N.POSITION, None), named.pop(WINDOW_TOKENS, None)
        states = {n: named.pop(n) for n in self.states}
        whole = RING_CACHES + (N.CONV_STATE, DELTA_STATE)
        reads = {n: s if n in whole or self.bucket is None else s[..., :self.bucket] for n, s in states.items()}
        if DELTA_STATE in states:  # the recurrent state is taken after the window's real tokens
            named[WINDOW_TOKENS] = tokens
        outs = tuple(self.module(**named, **reads))
        if not self.writes:
            for state in states.values():
                state[..., :1] = state[..., :1].clone()
            return outs
        for (name, state), new in zip(states.items(), outs[self.outputs:], strict=True):
            if name == N.CONV_STATE:
                state.copy_(conv_state_after(state, new, tokens))
            elif name == DELTA_STATE:
                state.copy_(new)
            elif name in RING_CACHES:
                state.copy_(onehot_write(state, new, window_slots(position, self.window, state.shape[-1])))
            else:  # a slice update at `position`; the runtime's windows fit in the context
                p = position[0].item()
                torch._check(p >= 0)
                torch._check(p + self.window <= state.shape[-1])
                state[:, :, :, p:p + self.window] = new
        return outs[:self.outputs]


def _remainder(x: torch.Tensor, y: Any) -> torch.Tensor:
    """aten.remainder.Scalar, which coreai-torch does not lower, through fmod, which it does: the
    remainder takes the divisor's sign, ((x fmod y) + y) fmod y (the ring's slots: p mod R)."""
    return torch.ops.aten.fmod.Scalar(torch.ops.aten.add.Scalar(torch.ops.aten.fmod.Scalar(x, y), y), y)


def decompositions(ct: Any) -> dict:
    """coreai-torch's decomposition table, with `_remainder` for aten.remainder.Scalar."""
    return {**ct.get_decomp_table(), torch.ops.aten.remainder.Scalar: _remainder}


def _argument_order(module: torch.nn.Module, io: dict) -> list[str]:
    """The manifest's input names in the order the module's forward takes them. A parameter the
    manifest does not declare must be optional (a family's extra input, e.g. a sliding mask)."""
    params = inspect.signature(module.forward).parameters
    declared = {t["name"] for t in io["inputs"]}
    missing = [n for n, p in params.items() if n not in declared and p.default is inspect.Parameter.empty]
    if declared - set(params) or missing:
        raise CoreAIError(f"{type(module).__name__}.forward takes {list(params)}, the manifest declares "
                          f"{sorted(declared)}")
    return [n for n in params if n in declared]


def _environment_tools_on_path() -> None:
    """coreai-opt's k-means compiles a torch C++ extension on first use, which runs `ninja` from the
    PATH: put this interpreter's scripts folder (where the coreai extra installs it) on the PATH of
    the process, as an activated environment would, for an export run without activating it."""
    import os
    import sysconfig

    scripts = sysconfig.get_path("scripts")
    if scripts and scripts not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = os.pathsep.join(filter(None, [scripts, os.environ.get("PATH")]))


def palettize(program: Any, compression: Compression) -> Any:
    """`program` with every weight of at least MIN_PALETTIZED_WEIGHTS elements palettized by coreai-opt's
    k-means: 2**bits fp values, one table per tensor (group_size 0) or per group of output channels."""
    from coreai_opt.coreai_utils import CompressionGranularity, palettize_weights

    _environment_tools_on_path()
    grouped = bool(compression.group_size)
    return palettize_weights(program, lut_dtype=None, n_bits=compression.bits,
                             granularity=(CompressionGranularity.PER_GROUPED_CHANNEL if grouped
                                          else CompressionGranularity.PER_TENSOR),
                             group_size=compression.group_size or 32, weight_num_threshold=MIN_PALETTIZED_WEIGHTS,
                             num_kmeans_workers=1)


def write_asset(modules: dict[str, torch.nn.Module], functions: dict[str, dict], dtype: torch.dtype, path: Path,
                compression: Compression | None = None) -> None:
    """One `.aimodel` at `path` with a function per entry of `modules` ({function: module}), each
    exported on inputs of the shapes in `functions` (the manifest's {function: io}) and named as there."""
    ct = coreai_torch()
    converter = ct.TorchConverter(mode=ct.TorchConverter.Mode.RELEASE)
    for fn, module in modules.items():
        io = functions[fn]
        feed = example_inputs(io, dtype)
        states = [t["name"] for t in io.get("states", [])]
        if states:  # positional: the inputs, then the states
            module, order = StateFunction(module, io), [t["name"] for t in io["inputs"]]
            args, kwargs = tuple(feed[n] for n in order + states), {}
        else:
            order = _argument_order(module, io)
            args, kwargs = (), {n: feed[n] for n in order}
        try:
            program = torch.export.export(module, args, kwargs)
            converter.add_exported_program(program.run_decompositions(decompositions(ct)), input_names=order,
                                           output_names=[t["name"] for t in io["outputs"]], state_names=states,
                                           entrypoint_name=fn)
        except Exception as exc:  # torch.export and the converter raise many kinds; name the function
            raise CoreAIError(f"coreai-torch could not convert {path.stem}/{fn}: {type(exc).__name__}: {exc}") from exc
    program = converter.to_coreai()
    if compression is not None:
        program = palettize(program, compression)
    program.save_asset(path)


def package_compression(plan: ExportPlan) -> Compression | None:
    """The compression of every weight of the export (check_coreai allows one scheme for all parts)."""
    return plan.compression("embed_tokens.weight")


def write_assets(plan: ExportPlan, manifest: dict, folder: Path,
                 modules_of: Callable[[dict, str], dict[str, torch.nn.Module]],
                 progress: Callable[[PackageSpec], None] | None = None) -> None:
    """Write every package of `plan` as a `.aimodel` into `folder`.

    `modules_of(manifest, model)` returns the eval-mode modules {function: module} of one manifest
    model with its weights in the export precision; one model's weights are in memory at a time.
    """
    dtype = torch.float16 if plan.options.precision == "fp16" else torch.float32
    for spec in plan.packages:
        modules = modules_of(manifest, spec.model)
        functions = manifest["models"][spec.model]["functions"]
        write_asset({fn: modules[fn] for fn in spec.functions}, functions, dtype, folder / spec.file,
                    package_compression(plan) if spec.model != "cache_update" else None)
        del modules
        if progress is not None:
            progress(spec)


__all__ = ["structure", "validate_assets", "CoreAIError", "coreai_torch", "write_asset", "write_assets"]


_IO_TYPE = re.compile(r"\((\w+), ([\d ×]+)\)")
_DTYPES = {"Float16": "float16", "Float32": "float32", "Int32": "int32"}
# control flow and dynamic shapes, which the exported graphs (static, straight-line) never hold
_DYNAMIC_OPS = ("while", "cond", "if", "case", "dynamic")


def function_io(asset: Any, function: str) -> dict[str, dict[str, tuple[str, list[int]]]]:
    """{"inputs"|"states"|"outputs": {name: (dtype, shape)}} of one function, as coreai-core reads
    the asset ("states" empty for a function without)."""
    summary = asset.summary()

    def parse(pairs: list[tuple[str, str]]) -> dict[str, tuple[str, list[int]]]:
        found = {}
        for name, described in pairs:
            m = _IO_TYPE.search(described)
            found[name] = ((_DTYPES.get(m.group(1), m.group(1)), [int(d) for d in m.group(2).split("×")])
                           if m else (described, []))
        return found
    return {"inputs": parse(summary.function_inputs(function)), "states": parse(summary.function_states(function)),
            "outputs": parse(summary.function_outputs(function))}


def structure(path: Path, precision: str | None = None) -> tuple[dict[str, Any], list[str]]:
    """What coreai-core's bindings read back from the saved program at `path`, without running it,
    and the rules it breaks: a tensor dimension over limits.MAX_DIM, float I/O not in `precision`
    ("fp16": float16, as the Neural Engine takes it), control flow or dynamic-shape ops.

    Returns ({"functions": {name: io}, "operations": {op: count}, "largest_dim": (dim, op)}, violations),
    each violation (rule, function or None, message) with inspect's rule ids.
    """
    coreai_torch()
    from coreai._compiler import ir
    from coreai.authoring.asset import AIModelAsset

    from ..limits import MAX_DIM, PRECISION_DTYPES

    asset = AIModelAsset.load(path)
    dims: list[tuple[int, str]] = [(0, "")]
    ops: dict[str, int] = {}

    def visit(op: Any) -> Any:
        name = op.operation.name
        ops[name] = ops.get(name, 0) + 1
        for result in op.operation.results:
            if isinstance(result.type, ir.ShapedType) and result.type.has_rank:
                dims.extend((d, name) for d in result.type.shape)
        return ir.WalkResult.ADVANCE

    asset.program._module._mlir_module.operation.walk(visit)  # noqa: SLF001 (the MLIR module itself)
    functions = {fn: function_io(asset, fn) for fn in asset.summary().function_names}
    violations = []
    largest = max(dims)
    if largest[0] > MAX_DIM:
        violations.append(("max-dim", None, f"{largest[1]} has a dimension of {largest[0]}, over {MAX_DIM}"))
    if any(d < 0 for d, _ in dims):
        violations.append(("dynamic-op", None, "a tensor has a dynamic dimension"))
    violations += [("dynamic-op", None, f"op {name} (control flow or dynamic shapes)") for name in ops
                   if any(word in name.rpartition(".")[2] for word in _DYNAMIC_OPS)]
    want = PRECISION_DTYPES.get(precision or "")
    for fn, io in functions.items():
        for kind, tensors in io.items():
            violations += [("fp32-io", fn, f"{kind[:-1]} {name} is {dtype}, not {want}")
                           for name, (dtype, _) in tensors.items() if want and dtype.startswith("float")
                           and dtype != want]
    return {"functions": functions, "operations": ops, "largest_dim": largest}, violations


def validate_assets(out: Path) -> dict:
    """Check a Core AI export folder: hashes, and each asset's functions, their inputs and outputs
    (names, dtypes, shapes) against the manifest. Raises ManifestError naming the first problem."""
    from ..contract.manifest import ManifestError, read_manifest
    from coreai.authoring.asset import AIModelAsset

    manifest = read_manifest(out, check_hashes=True)
    assets: dict[str, Any] = {}
    for model, entry in manifest["models"].items():
        for fn, f in entry["functions"].items():
            asset = assets.setdefault(f["file"], AIModelAsset.load(out / f["file"]))
            if f["function_name"] not in asset.summary().function_names:
                raise ManifestError(f"{f['file']} has no function {f['function_name']!r} ({model}/{fn})")
            io = function_io(asset, f["function_name"])
            if set(io["states"]) != {t["name"] for t in f.get("states", [])}:
                raise ManifestError(f"{f['file']} ({fn}) has states {sorted(io['states'])}, the manifest says "
                                    f"{sorted(t['name'] for t in f.get('states', []))}")
            for kind in ("inputs", "states", "outputs"):
                for t in f.get(kind, []):
                    got = io[kind].get(t["name"])
                    if got != (t["dtype"], t["shape"]):
                        raise ManifestError(f"{f['file']} ({fn}) {kind[:-1]} {t['name']!r} is "
                                            f"{'missing' if got is None else f'{got[0]}{got[1]}'}, the manifest "
                                            f"says {t['dtype']}{t['shape']}")
    return manifest
