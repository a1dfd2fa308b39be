"""Whether batching requests that share a prefix pays, on the backend in use.

A batch runs its requests as branches over the shared prefix (scheduler.py): the prefix is
prefilled once, then every step runs one token of each branch, first its own prompt tokens one per
step, then its answer. The alternative runs them one after the other: each prefills its prompt (all
but the prefix, for every request after the first: the prefix is reused, from the prompt cache or
from what the model holds) in windows of the export's prefill length, then decodes one token a step.
So for requests over a `prefix`-token prefix with `own` tokens after it and answers of at most
`new` tokens:

    batch      = prefill(prefix) + max(own + new - 1) x step(branches)
    one by one = prefill(prefix + own[0]) + sum over the rest of prefill(own) + sum(new - 1) x step(1)

(its cached part of the prefix left out of both; without a prompt cache every request prefills the
prefix again one after the other). A batch runs when it costs less. What a step
costs is priced per backend:

* on Core ML and Core AI by the device model (contract/device_model.py) of one chip: a step of the
  prefill window, of the decode function or of the cascade's function after the filled positions;
* elsewhere (torch, mil) by the step times measured on this machine: every step the server runs is
  timed, a window of the pipeline by its rows (the tokens it computes), a batch step by its
  branch slots, and a step is priced at the fastest of its last measurements (a machine shared
  with other work only ever slows a step down, and what a step costs when nothing does is what
  both plans are priced at), and never above a step of more rows. A window of rows not measured
  yet is priced on the line between the nearest rows measured; a batch step of slots not measured
  yet as a window of its rows, times what a batch step of the nearest slots measured cost over
  such a window (1 before any batch has run). Until a window has been measured nothing is known,
  and requests run one after the other, which costs no more than it did before.

Answers that end early (end of sequence, a stop string) cost less either way; the rule prices both
at their longest.
"""

from __future__ import annotations

import bisect
import platform
import subprocess
import threading
from collections import deque
from dataclasses import dataclass
from typing import Sequence

from ..contract import device_model as dm
from ..contract.manifest import decode_function, window_cascade
from ..errors import InvalidArgumentError
from .options import BATCHING

WINDOW, BATCH = "window", "batch"  # what a measured step ran: a pipeline window, a batch's step
DEFAULT_CHIP = "M4"  # the device model's chip when the host's is not one it knows


def check_batching(value: str) -> str:
    if value not in BATCHING:
        raise InvalidArgumentError(f"--batching {value!r} is not one of {', '.join(BATCHING)}")
    return value


@dataclass(frozen=True)
class Group:
    """Requests that could run as one batch: the shared prefix's tokens (`cached` of them already
    held), each request's own tokens after it and its answer's largest length, the branch slots
    the batch would run (`lanes`: the rows of each step), and whether one after the other each
    request after the first reuses the prefix (`reused`: there is a prompt cache)."""

    prefix: int
    own: Sequence[int]
    new: Sequence[int]
    lanes: int
    cached: int = 0
    reused: bool = True


class Prices:
    """Seconds of the steps a plan runs; `batch_pays` compares the two plans (module docstring)."""

    prefill_length: int = 1

    def window(self, tokens: int, filled: int) -> float | None:
        """A pipeline window of `tokens` tokens after `filled` positions (None: not known yet)."""
        raise NotImplementedError

    def cascade(self, lanes: int, prefix: int) -> float | None:
        """One batch step of `lanes` branches over a `prefix`-token prefix (None: not known yet)."""
        raise NotImplementedError

    def prefill(self, tokens: int, filled: int) -> float | None:
        """`tokens` prompt tokens after `filled` positions, in windows of the prefill length."""
        total = 0.0
        for start in range(0, tokens, self.prefill_length):
            t = self.window(min(self.prefill_length, tokens - start), filled + start)
            if t is None:
                return None
            total += t
        return total

    def batch_seconds(self, g: Group) -> float | None:
        steps = max(o + n - 1 for o, n in zip(g.own, g.new))
        prefill, step = self.prefill(g.prefix - g.cached, g.cached), self.cascade(g.lanes, g.prefix)
        return None if prefill is None or step is None else prefill + steps * step

    def sequential_seconds(self, g: Group) -> float | None:
        first = self.prefill(g.prefix - g.cached + g.own[0], g.cached)
        rest = [self.prefill(o, g.prefix) if g.reused else self.prefill(g.prefix + o, 0) for o in g.own[1:]]
        step = self.window(1, g.prefix + max(g.own))
        if first is None or step is None or None in rest:
            return None
        return first + sum(rest) + sum(n - 1 for n in g.new) * step

    def batch_pays(self, g: Group) -> bool:
        """Whether running `g` as one batch is priced below running it one request after another
        (not when either price is unknown)."""
        batch, alone = self.batch_seconds(g), self.sequential_seconds(g)
        return batch is not None and alone is not None and batch < alone

    def observe(self, kind: str, size: int, seconds: float) -> None:
        """A step the server ran: a WINDOW of `size` tokens, or a BATCH step of `size` branch slots
        (only measured prices use it)."""


class DevicePrices(Prices):
    """Steps priced by the device model on `chip` (contract/device_model.py), from the manifest."""

    def __init__(self, manifest: dict, chip: dm.Chip):
        self.manifest, self.chip = manifest, chip
        self.prefill_length = int(manifest["prefill_length"])

    def window(self, tokens: int, filled: int) -> float:
        m = self.manifest
        cost = dm.decode_step(m, filled) if tokens == 1 else dm.step_cost(m, "prefill", filled, tokens=tokens)
        return self.chip.seconds(cost)

    def cascade(self, lanes: int, prefix: int) -> float:
        return self.chip.seconds(dm.cascade_cost(self.manifest, prefix, lanes))


class MeasuredPrices(Prices):
    """Steps priced by the times measured on this machine (module docstring). `direct`: the
    backend computes a window at its own tokens (torch's direct caches), else at the prefill
    length, padded (and a token decoded through the prefill window too, where the export has no
    decode function). Thread-safe: the worker observes, anything may price."""

    KEEP = 32  # the measurements kept per kind and rows

    def __init__(self, manifest: dict, direct: bool):
        self.prefill_length = int(manifest["prefill_length"])
        self.direct = direct
        self.decodes = decode_function(manifest)
        self.in_window = window_cascade(manifest)  # a batch step is a window of the pipeline
        self._seen: dict[tuple[str, int], deque[float]] = {}
        self._lock = threading.Lock()

    def observe(self, kind: str, size: int, seconds: float) -> None:
        key = (kind, self.rows(size) if kind == WINDOW else size)
        with self._lock:
            self._seen.setdefault(key, deque(maxlen=self.KEEP)).append(seconds)

    def _known(self, kind: str) -> dict[int, float]:
        """Each size of `kind` measured: the fastest of its times, and no more than any larger size's
        (a step of fewer rows costs no more: a size measured a few times, each slowed by other work,
        is priced by the larger ones measured more often)."""
        with self._lock:
            fastest = {r: min(times) for (k, r), times in self._seen.items() if k == kind}
        known, cap = {}, float("inf")
        for r in sorted(fastest, reverse=True):
            cap = known[r] = min(fastest[r], cap)
        return known

    def measured(self, kind: str, rows: int) -> float | None:
        """The price of a step of `kind` at `rows` measured (`_known`); between rows measured, on the
        line between the nearest; past them, the nearest's time scaled by the rows (None: none of
        `kind`)."""
        known = self._known(kind)
        if not known:
            return None
        if rows in known:
            return known[rows]
        keys = sorted(known)
        i = bisect.bisect_left(keys, rows)
        if 0 < i < len(keys):
            lo, hi = keys[i - 1], keys[i]
            return known[lo] + (known[hi] - known[lo]) * (rows - lo) / (hi - lo)
        nearest = keys[0] if i == 0 else keys[-1]
        return known[nearest] * (rows / nearest if rows > nearest else 1.0)

    def rows(self, tokens: int) -> int:
        """The rows a window of `tokens` tokens computes (Pipeline._window)."""
        if self.direct or tokens == 1 and self.decodes == "decode":
            return tokens
        return self.prefill_length

    def window(self, tokens: int, filled: int) -> float | None:
        return self.measured(WINDOW, self.rows(tokens))

    def batch_rows(self, lanes: int) -> int:
        """The rows a batch step of `lanes` slots computes: a padded window's through the window
        (but on torch), else one per slot."""
        return self.prefill_length if self.in_window and not self.direct else lanes

    def cascade(self, lanes: int, prefix: int) -> float | None:
        window = self.measured(WINDOW, self.batch_rows(lanes))
        batches = self._known(BATCH)
        if lanes in batches or window is None:
            return batches.get(lanes)
        if not batches:
            return window
        nearest = min(batches, key=lambda n: (abs(n - lanes), n))
        return window * batches[nearest] / self.measured(WINDOW, self.batch_rows(nearest))


def host_chip() -> dm.Chip:
    """The device model's chip for this Mac (its `machdep.cpu.brand_string`, "Apple M2 Pro"), or
    DEFAULT_CHIP where that names none the model knows."""
    if platform.system() == "Darwin":
        try:
            brand = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True,
                                   timeout=5).stdout.strip()
            return dm.chip(brand.removeprefix("Apple ").strip())
        except (OSError, subprocess.SubprocessError, InvalidArgumentError):
            pass
    return dm.chip(DEFAULT_CHIP)


def prices_for(backend, manifest: dict) -> Prices:
    """The prices of `backend`: the device model's on Core ML and Core AI, measured elsewhere."""
    if getattr(backend, "name", None) in ("coreml", "coreai"):
        return DevicePrices(manifest, host_chip())
    return MeasuredPrices(manifest, bool(getattr(backend, "direct_cache", False)))
