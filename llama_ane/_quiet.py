"""Keep third-party messages that never matter to a user off the screen.

coremltools logs, as it is imported, that it has not been tested with the installed torch and, off
macOS, that it cannot load its native Core ML bindings ("Failed to load _MLModelProxy: ...") - once
per binding, nine lines before the first word of ours. Neither changes what llama-ane does: Core ML
predictions run only on macOS anyway (the coreml backend says so itself), and conversion is tested
with the pinned torch. Only these messages are dropped; every other coremltools warning still
shows. `llama-ane -v` shows them all. The command line and the package's two entry points
(`llama_ane.load`, `llama_ane.export_model`) drop them; importing `llama_ane` changes no logging.
"""

from __future__ import annotations

import logging
import re

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


class _DropHarmless(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not HARMLESS.search(record.getMessage())


_FILTER = _DropHarmless()


def quiet_coremltools(quiet: bool = True) -> None:
    """Drop (or, with quiet False, show again) coremltools' known-harmless import messages."""
    for name in LOGGERS:
        logger = logging.getLogger(name)
        if quiet:
            logger.addFilter(_FILTER)  # adding the same filter twice keeps one
        else:
            logger.removeFilter(_FILTER)
