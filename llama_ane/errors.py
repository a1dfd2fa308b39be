"""The one base class of the errors that bad input or a failure the user can act on raise.

Every layer's own error (ConfigError, CheckpointError, ManifestError, BackendError, ...) derives from
`LlamaANEError`, and its message says what was wrong and what to do; the command line prints such an
error as one `Error:` line with a non-zero exit, and lets anything else (a bug) show its traceback.
This module imports nothing from the package, so every layer may import it.
"""

from __future__ import annotations


class LlamaANEError(Exception):
    """Bad input or an environment problem, with a message that names it and the fix."""


class InvalidArgumentError(LlamaANEError, ValueError):
    """An argument outside what it may be (a size below 1, a sampling value out of range, ...)."""


__all__ = ["InvalidArgumentError", "LlamaANEError"]
