"""Keep third-party messages that never matter to a user off the screen.

coremltools logs, as it is imported, that it has not been tested with the installed torch and, off
macOS, that it cannot load its native Core ML bindings ("Failed to load _MLModelProxy: ...") - once
per binding, nine lines before the first word of ours. Neither changes what llama-ane does: Core ML
predictions run only on macOS anyway (the coreml backend says so itself), and conversion is tested
with the pinned torch.

The Core AI packages (`--target coreai`, the coreai backend) add their own: coreai-torch warns
that it was validated with torch<=2.13.0 when it finds 2.13.0+cpu (the same release), torch.export
warns of its own deprecated `LeafSpec` once per traced function, coreai-torch draws a rich progress
display per program beside the export's bar (a terminal keeps every frame: about 80 lines for a
2-layer export) and prints "converting N program(s)", and coreai-core's runtime writes "ODIE
[default]: Loading function 'NAME'" for each function it loads, from native code, to the process's
standard error.

Only these messages are dropped (QUIET_LOGS, QUIET_WARNINGS, and the two patches applied when
coreai-torch's and coreai-core's modules are imported); every other warning and error still shows.
`llama-ane -v` shows them all. The command line and the package's two entry points
(`llama_ane.load`, `llama_ane.export_model`) drop them; importing `llama_ane` changes nothing.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import logging
import os
import re
import sys
import tempfile
import warnings
from typing import Callable, Iterator

# the loggers that emit them (coremltools/__init__.py and the bindings' loaders in coremltools.models)
LOGGERS = ("coremltools", "coremltools.models.model", "coremltools.models.compute_device",
           "coremltools.models.compute_plan",
           # coremltools imports torchao and scikit-learn where they are installed (the Core AI extra
           # brings them): their CUDA kernels and the versions coremltools knows are beside the point
           "torchao", "torchao.kernel.intmm", "torch.utils._pytree")
HARMLESS = re.compile(r"Torch version .* has not been tested with coremltools"
                      r"|Failed to load _ML\w+Proxy: No module named 'coremltools\.libcoremlpython'"
                      r"|scikit-learn version .* is not supported"
                      r"|Failed to load .*torchao/_C\w*\.\S+\.so"
                      r"|Detected no triton, on systems without Triton"
                      r"|is an Enum subclass and is now natively supported by torch\.compile")
# Python warnings (message at its start, category) dropped from the Core AI path
QUIET_WARNINGS = ((r"coreai-torch has only been validated with torch", UserWarning),
                  (r"`isinstance\(treespec, LeafSpec\)` is deprecated", FutureWarning))
CONVERTING = re.compile(r"converting \d+ program\(s\) to Core AI")  # coreai-torch's line per conversion
LOADING = re.compile(rb"ODIE \[default\]: Loading function '[^'\n]*'\r?\n")  # coreai-core's, per function

_quiet = False  # whether the patches below drop their messages (they stay in place once applied)


class _DropHarmless(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not HARMLESS.search(record.getMessage())


_FILTER = _DropHarmless()


def quiet_coremltools(quiet: bool = True) -> None:
    """Drop (or, with quiet False, show again) the known-harmless messages of coremltools and the
    Core AI packages (see the module's docstring)."""
    global _quiet
    _quiet = quiet
    for name in LOGGERS:
        logger = logging.getLogger(name)
        if quiet:
            logger.addFilter(_FILTER)  # adding the same filter twice keeps one
        else:
            logger.removeFilter(_FILTER)
    for message, category in QUIET_WARNINGS:
        warnings.filters[:] = [f for f in warnings.filters
                               if not (f[0] == "ignore" and f[1] is not None and f[1].pattern == message
                                       and f[2] is category)]
        if quiet:
            warnings.filterwarnings("ignore", message=message, category=category)
    if quiet:
        after_import("coreai_torch._utils", _quiet_coreai_torch)
        after_import("coreai.runtime._aimodel", _quiet_coreai_runtime)


quiet_third_party = quiet_coremltools  # the name for what it covers now


# ---- patches applied when a module is imported ---------------------------------------------------------------

class _PatchingLoader(importlib.abc.Loader):
    """A module's own loader, then `patch(module)` once the module has run."""

    def __init__(self, loader, patch: Callable) -> None:
        self._loader, self._patch = loader, patch

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        self._patch(module)

    def __getattr__(self, name):  # get_source, is_package, get_resource_reader, ...
        return getattr(self._loader, name)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for a module named in `patches` it asks the other finders and wraps the
    loader they give, so the patch runs as the module is first imported."""

    def __init__(self) -> None:
        self.patches: dict[str, Callable] = {}

    def find_spec(self, name, path, target=None):
        patch = self.patches.get(name)
        if patch is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _PatchingLoader(spec.loader, patch)
                return spec
        return None


_HOOK = _AfterImport()


def after_import(module: str, patch: Callable) -> None:
    """Run `patch(module)` once `module` is imported: now if it is, else when it first is."""
    if module in _HOOK.patches:
        return
    _HOOK.patches[module] = patch
    if module in sys.modules:
        patch(sys.modules[module])
    elif _HOOK not in sys.meta_path:
        sys.meta_path.insert(0, _HOOK)


def _quiet_coreai_torch(utils) -> None:
    """coreai-torch's progress display (`_ProgressBar`): its rich bars off and its "converting N
    program(s)" line dropped while quiet."""
    if getattr(utils, "_llama_ane_quiet", False):
        return
    utils._llama_ane_quiet = True
    progress, bar = utils.Progress, utils._ProgressBar

    class Progress(progress):
        def __init__(self, *args, **kwargs):
            if _quiet:
                kwargs["disable"] = True
            super().__init__(*args, **kwargs)

    printed = bar.print

    def print_(self, *args, **kwargs):
        if _quiet and args and CONVERTING.search(str(args[0])):
            return None
        return printed(self, *args, **kwargs)

    utils.Progress, bar.print = Progress, print_


def _quiet_coreai_runtime(module) -> None:
    """coreai-core's `AIModel.load_function`: its native "Loading function" line dropped while quiet."""
    model = module.AIModel
    if getattr(model, "_llama_ane_quiet", False):
        return
    model._llama_ane_quiet = True
    load = model.load_function

    def load_function(self, *args, **kwargs):
        if not _quiet:
            return load(self, *args, **kwargs)
        with native_stderr_without(LOADING):
            return load(self, *args, **kwargs)

    model.load_function = load_function


@contextlib.contextmanager
def native_stderr_without(pattern: re.Pattern) -> Iterator[None]:
    """Standard error (the file descriptor, so native code's writes too) held while the block runs,
    then written out without the lines `pattern` matches. What other threads write meanwhile comes
    out after the block, in order."""
    fd = 2  # where native code writes, whatever sys.stderr is
    with tempfile.TemporaryFile() as held:
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        try:
            saved = os.dup(fd)
        except OSError:  # no standard error at all: nothing to hold
            yield
            return
        os.dup2(held.fileno(), fd)
        try:
            yield
        finally:
            with contextlib.suppress(Exception):
                sys.stderr.flush()
            os.dup2(saved, fd)
            os.close(saved)
            held.seek(0)
            kept = pattern.sub(b"", held.read())
            if kept:
                os.write(fd, kept)
