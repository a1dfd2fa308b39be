"""The interface every runtime backend implements: run one function of one exported model.

A backend knows nothing of generation. The pipeline (`runtime/pipeline.py`) names models and
functions exactly as `manifest.json` does and passes numpy arrays with the manifest's shapes and
dtypes; the backend returns the outputs named in the manifest.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Mapping

import numpy as np

from ...errors import LlamaANEError

# the sets of states a stateful backend keeps per package (caches in use at once, e.g. a chat and a
# document); beyond them the least recently used are copied back into their arrays and dropped
HELD_STATES = 4


class BackendError(LlamaANEError, RuntimeError):
    """A backend could not load or run a model; the message names the model and function."""


class Backend(ABC):
    """Runs the functions of an export.

    Attributes
    ----------
    name : str
        "torch", "coreml" or "mil".
    dtype : numpy dtype
        The floating dtype the backend wants at its inputs (float16 for fp16 exports).
    direct_cache : bool
        True if the backend takes caches cut to their filled positions and lets the pipeline write
        them in place (only a backend that runs the torch modules can: the programs have fixed shapes).
    """

    name: str = "base"
    dtype: np.dtype = np.dtype(np.float16)
    direct_cache: bool = False

    @abstractmethod
    def predict(self, model: str, function: str, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run `function` of manifest model `model` (e.g. "chunk_0", "prefill").

        `inputs` maps each input name of that function in the manifest to an array of the
        manifest shape. Returns every output named there, as numpy arrays.
        """

    def prepare(self, models: list[str]) -> None:
        """Load manifest models `models` now instead of on first use (optional)."""

    def load_function(self, model: str, function: str) -> bool:
        """Load one function of manifest model `model` now, and keep it (`bench` times each first load
        and reads the memory it wires); False where the backend cannot load a function apart."""
        return False

    def release(self, model: str) -> None:
        """Drop what the backend holds for manifest model `model` (its weights); it loads again
        on next use. Streamed scoring calls this to keep one model in memory at a time."""

    def sync_states(self) -> None:
        """Make the cache arrays handed in as states hold what the backend's own states hold (a
        backend that keeps them elsewhere, as Core ML's MLState; the others write the arrays
        themselves and have nothing to do)."""

    def close(self) -> None:
        """Release models and threads. Safe to call twice."""
