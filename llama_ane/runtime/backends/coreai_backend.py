"""The coreai backend: runs an export's Core AI assets (`--target coreai`) through Apple's runtime.

coreai-core ships a runtime that executes `.aimodel` programs on Linux as well as macOS. Off macOS
it runs on the CPU only, after lowering each program (`AIModelAsset.executable()`), which is what
this backend uses everywhere: it checks that the saved programs compute what the torch modules
do, not how fast or where a device would run them. Assets load on first use, once each, until
released; the functions of one asset share its loaded program.

The runtime's API is asynchronous: one event loop on a thread of its own serves every call, so
the pipeline may call from several threads (cache updates run in the background).

coreai-core 1.0.0b3's runtime keeps every output buffer it returns allocated, so the process
grows by the outputs it receives: the backend counts them and,
past `output_limit_bytes` (limits.COREAI_OUTPUT_LIMIT_BYTES), refuses to run more with an error
that says to restart the process (docs/coreai.md). An export with `--kv-cache state` keeps its
caches out of the outputs, which then are the hidden states and logits.

A stateful export's caches (`--kv-cache state`) are Core AI states: arrays the runtime holds and
each call reads and writes (`function(inputs, state={name: NDArray})`). As with Core ML's
MLState, one set stands for each set of cache arrays the pipeline hands in (keyed by its arrays),
filled from them when first seen and shared by every function of the asset; `sync_states`
copies them back into the arrays, as does dropping the least recently used beyond `HELD_STATES`
per asset, or releasing the asset.
"""

from __future__ import annotations

import asyncio
import threading
from collections import OrderedDict
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from ...contract.manifest import function_entry, function_states
from ...contract.options import COREAI_INSTALL_HINT
from ...limits import COREAI_OUTPUT_LIMIT_BYTES
from .base import HELD_STATES, Backend, BackendError



_received = [0]  # output bytes this process took from the runtime, which keeps them all
_received_lock = threading.Lock()


def received_bytes() -> int:
    """Bytes of outputs this process has received from Core AI's runtime (every backend's)."""
    return _received[0]


def _count_received(n: int) -> None:
    with _received_lock:
        _received[0] += n


class CoreAIBackend(Backend):
    """Execute the `.aimodel` assets of an export with coreai-core's runtime.

    Parameters
    ----------
    export_dir : Path
        The export folder (manifest.json and the .aimodel assets).
    manifest : dict
        Its parsed manifest (an export made with --target coreai).
    """

    name = "coreai"

    def __init__(self, export_dir: Path, manifest: dict, *, output_limit_bytes: int = COREAI_OUTPUT_LIMIT_BYTES):
        try:
            from coreai.authoring.asset import AIModelAsset
            from coreai.runtime import NDArray
        except ImportError as e:
            raise BackendError(f"the coreai backend needs the Python package {e.name or e}: {COREAI_INSTALL_HINT}") from None
        if manifest.get("deployment_target") != "coreai":
            raise BackendError(f"{export_dir} holds Core ML packages (target {manifest.get('deployment_target')}), "
                               "not Core AI assets: use --backend mil or coreml, or export with --target coreai")
        self._asset_class, self._ndarray = AIModelAsset, NDArray
        self.export_dir, self.manifest = Path(export_dir), manifest
        self.dtype = np.dtype(np.float16 if manifest.get("precision") == "fp16" else np.float32)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="coreai-runtime", daemon=True)
        self._thread.start()
        self._models: dict[str, tuple[AsyncExitStack, Any]] = {}  # file -> (its context, the loaded model)
        self._functions: dict[tuple[str, str], Any] = {}
        # (asset file, id of the caller's first state array) -> ({name: NDArray}, the caller's arrays by name)
        self._states: OrderedDict[tuple[str, int], tuple[dict[str, Any], dict[str, np.ndarray]]] = OrderedDict()
        self._closed = False
        self.output_limit_bytes = output_limit_bytes

    def _run(self, coro) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    async def _function(self, file: str, name: str) -> Any:
        """Function `name` of asset `file`, the asset lowered and loaded on first use. Runs on the
        loop's thread only, so nothing here needs a lock."""
        if (file, name) not in self._functions:
            if file not in self._models:
                path = self.export_dir / file
                if not path.is_dir():
                    raise BackendError(f"{path} is missing; the export is incomplete, re-run `llama-ane export`")
                stack = AsyncExitStack()
                model = await stack.enter_async_context(self._asset_class.load(path).executable())
                self._models[file] = (stack, model)
            model = self._models[file][1]
            if name not in model.function_names:
                raise BackendError(f"{file} has no function {name!r} (it has {', '.join(model.function_names)}); "
                                   "the asset and manifest.json disagree: re-export")
            self._functions[file, name] = model.load_function(name)
        return self._functions[file, name]

    async def _predict(self, file: str, name: str, feed: dict[str, np.ndarray],
                       states: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        function = await self._function(file, name)
        held = self._state(file, states) if states else {}
        out = await function({k: self._ndarray(v) for k, v in feed.items()}, state=held)
        return {k: v.numpy() for k, v in out.items()}

    def _state(self, file: str, arrays: dict[str, np.ndarray]) -> dict[str, Any]:
        """The runtime's states standing for the caller's cache arrays in asset `file`, made from
        them the first time they are seen, and of those the ones this call's function declares
        (`arrays`' names: the cascade's function takes the K/V caches but not the conv or
        recurrent states the window functions write, and the runtime refuses a state a function
        does not declare). On the loop's thread only."""
        key = (file, id(next(iter(arrays.values()))))
        held = self._states.get(key)
        if held is None or any(name in held[1] and held[1][name] is not a for name, a in arrays.items()):
            held = self._states[key] = ({}, {})
            for old in [k for k in self._states if k[0] == file][:-HELD_STATES]:
                self._copy_back(*self._states.pop(old))
        for name, a in arrays.items():  # a state first passed to this function (the set's others kept)
            if name not in held[1]:
                held[0][name], held[1][name] = self._ndarray(np.ascontiguousarray(a, dtype=self.dtype)), a
        self._states.move_to_end(key)
        return {name: held[0][name] for name in arrays}

    @staticmethod
    def _copy_back(states: dict[str, Any], arrays: dict[str, np.ndarray]) -> None:
        for name, a in arrays.items():
            a[...] = states[name].numpy()

    async def _sync(self, files: set[str] | None = None, drop: bool = False) -> None:
        for key in [k for k in self._states if files is None or k[0] in files]:
            self._copy_back(*(self._states.pop(key) if drop else self._states[key]))

    def sync_states(self) -> None:
        """Copy every held state back into the cache arrays it stands for."""
        if not self._closed:
            self._run(self._sync())

    def load_function(self, model: str, function: str) -> bool:
        entry = function_entry(self.manifest, model, function)
        self._run(self._function(entry["file"], entry.get("function_name") or function))
        return True

    def predict(self, model: str, function: str, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run manifest function `function` of `model`; returns every output the manifest names."""
        entry = function_entry(self.manifest, model, function)
        feed = {}
        for spec in entry["inputs"]:
            if spec["name"] not in inputs:
                raise BackendError(f"{model}/{function} needs input {spec['name']!r}; got {sorted(inputs)}")
            dtype = np.int32 if spec["dtype"] == "int32" else self.dtype
            feed[spec["name"]] = np.ascontiguousarray(inputs[spec["name"]], dtype=dtype)
            if list(feed[spec["name"]].shape) != spec["shape"]:
                raise BackendError(f"{model}/{function} input {spec['name']!r} has shape "
                                   f"{list(feed[spec['name']].shape)}, the manifest says {spec['shape']}")
        if received_bytes() > self.output_limit_bytes:
            raise BackendError(
                f"Core AI's runtime keeps every output it returns, and this process has received "
                f"{received_bytes() / 1e6:.0f} MB of them (the limit is {self.output_limit_bytes / 1e6:.0f} MB): "
                "restart the process to free them; an export with --kv-cache state returns less per token")
        states = {}
        for spec in function_states(entry):  # the caller's cache arrays, which the held states stand for
            if spec["name"] not in inputs:
                raise BackendError(f"{model}/{function} needs state {spec['name']!r}; got {sorted(inputs)}")
            states[spec["name"]] = inputs[spec["name"]]
        try:
            out = self._run(self._predict(entry["file"], entry.get("function_name") or function, feed, states))
        except BackendError:
            raise
        except RuntimeError as exc:  # the runtime reports its failures as RuntimeError
            raise BackendError(f"coreai backend, {model}/{function}: {exc}") from exc
        _count_received(sum(a.nbytes for a in out.values()))
        missing = [s["name"] for s in entry["outputs"] if s["name"] not in out]
        if missing:
            raise BackendError(f"{entry['file']} ({model}/{function}) has no outputs {missing} that the manifest "
                               "names; the asset and manifest.json disagree: re-export")
        return {s["name"]: out[s["name"]] for s in entry["outputs"]}

    async def _release(self, files: set[str]) -> None:
        await self._sync(files, drop=True)
        for file in files:
            self._functions = {k: v for k, v in self._functions.items() if k[0] != file}
            held = self._models.pop(file, None)
            if held is not None:
                await held[0].aclose()

    def release(self, model: str) -> None:
        """Unload the assets `model`'s functions live in (their states copied back into the cache
        arrays and dropped); they load again on next use."""
        files = {f["file"] for f in self.manifest["models"].get(model, {}).get("functions", {}).values()}
        if not self._closed:
            self._run(self._release(files))

    def close(self) -> None:
        if self._closed:
            return
        self._run(self._release(set(self._models)))
        self._closed = True
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()
