"""Resident memory: what a runtime keeps wired for the functions of an export it holds loaded, and
how long their first load takes. A model from published measurements, not a measurement.

The load plan (`load_plan`) names the functions a runtime holds: every function the export's
phases call (prefill and decode in each context bucket, the cascade's branch step, the speculative
verify window, the cache updates). The Python backends and the Swift host load them on first use
and keep them; a session that runs every phase ends holding the whole plan.

What that costs depends on the runtime (`RUNTIMES`):

* **Core ML** (`.mlpackage`, multifunction or not): each function loaded for the Neural Engine was
  measured to wire its own copy of its package's weights, even within one multifunction package
  and one `MLModelAsset` (Anemll Forge, M6, macOS 27: four functions over a 537 MB program wired
  +0.54, +1.00, +1.55 and +1.75 GB as each loaded; one function of a 0.69 GB chunk wired
  1.05-1.31 GB). So the first function of a package wires 1.0-1.9x its weights, and each further
  one 0.37-1.02x (the fourth, a 64-row function, added 0.20 GB).
* **Core AI** (`.aimodel`): its entry points share one copy (the same program's four entry points
  wired +0.50 GB in all: 0.93x its weights).

Ranges are (low, high); `mid` is their middle. `weight_copy_bytes` is what one loaded copy of
every package's weights costs in the same model (each package's first function), so
`resident / weight_copy` counts the extra copies a plan holds.

First-load specialization: the device compiles every function on its first load; published for
one model on an M4 Max at 46 s for 7 functions and 717 s for 28 (john-rocky/edge-llm-bench), which
`first_load_seconds` scales between by function count alone (a power law through both points).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .options import COREAI

FORGE = ("Anemll Forge, FEEDBACK_ANE_MULTIFUNCTION_MEMORY.md (Anemll/anemll-forge, Sept 2026), "
         "measured on an M6 with macOS 27")
EDGE_BENCH = "john-rocky/edge-llm-bench, measured on an M4 Max"
MODELLED = ("modelled from published measurements on other machines (Core ML: each function loaded for the "
            "Neural Engine wires its own copy of its package's weights; Core AI: entry points share one), "
            "not measured here")


@dataclass(frozen=True)
class Runtime:
    """How a runtime wires a package's weights for the functions it loads: the first function's
    copy and each further function's, as multiples of the package's weight bytes (low, high)."""

    name: str
    first: tuple[float, float]
    further: tuple[float, float]
    source: str

    def factor(self, functions: int, case: str = "mid") -> float:
        """Multiples of a package's weights wired with `functions` of its functions loaded."""
        if functions <= 0:
            return 0.0
        pick = {"low": lambda r: r[0], "high": lambda r: r[1], "mid": lambda r: (r[0] + r[1]) / 2}[case]
        return pick(self.first) + (functions - 1) * pick(self.further)


RUNTIMES = {
    "coreml": Runtime("Core ML", (1.0, 1.9), (0.37, 1.02), FORGE),
    "coreai": Runtime("Core AI", (0.93, 0.93), (0.0, 0.0), FORGE),
}
# first-load specialization, (functions, seconds) measured for one model (EDGE_BENCH)
SPECIALIZATION_POINTS = ((7, 46.0), (28, 717.0))


def runtime_of(manifest: dict) -> Runtime:
    """The runtime an export's packages load in: Core AI for a --target coreai export, else Core ML."""
    return RUNTIMES["coreai" if manifest.get("deployment_target") == COREAI else "coreml"]


@dataclass(frozen=True)
class Loaded:
    """One function a runtime holds: its model and name in the manifest, the package file and the
    function's name inside it, and the package's weight bytes (0 for the cache updates' package)."""

    model: str
    function: str
    file: str
    function_name: str
    weight_bytes: int


def package_weight_bytes(manifest: dict, model: str) -> int:
    """A model's weight bytes as the Neural Engine holds them (forms decompressed at load count dense)."""
    w = manifest.get("weights", {}).get(model, {})
    return int(w.get("read_bytes", w.get("bytes", 0)))


def load_plan(manifest: dict) -> list[Loaded]:
    """The functions a runtime holds loaded to serve every phase the export has: all of its
    functions, in the manifest's order. A modelled export (`info --config`: no files) is laid out
    as the exporter would lay it out (contract.plan)."""
    from .options import COREAI_SUFFIX

    multi = manifest.get("multifunction", True)
    suffix = COREAI_SUFFIX if manifest.get("deployment_target") == COREAI else ".mlpackage"
    out = []
    for model, entry in manifest["models"].items():
        for fn, spec in entry["functions"].items():
            file = spec.get("file") or (f"{model}{suffix}" if multi else f"{model}_{fn}{suffix}")
            out.append(Loaded(model, fn, file, spec.get("function_name") or (fn if multi else "main"),
                              package_weight_bytes(manifest, model)))
    return out


@dataclass(frozen=True)
class Resident:
    """Resident memory of a load plan on one runtime, modelled: `bytes` (mid) and its (low, high)
    range, `weight_copy_bytes` (one loaded copy of every package's weights, mid), the functions it
    holds and what each package wires."""

    runtime: str
    bytes: int
    range: tuple[int, int]
    weight_copy_bytes: int
    functions: int
    packages: dict[str, dict]
    source: str

    @property
    def first_load_s(self) -> float:
        """Modelled first-load specialization of the functions held (`first_load_seconds`)."""
        return first_load_seconds(self.functions)

    @property
    def copies(self) -> float:
        """Resident bytes over one copy of the weights."""
        return self.bytes / self.weight_copy_bytes if self.weight_copy_bytes else 0.0

    def to_dict(self) -> dict:
        return {"modelled": MODELLED, "runtime": self.runtime, "resident_bytes": self.bytes,
                "resident_bytes_range": list(self.range), "weight_copy_bytes": self.weight_copy_bytes,
                "copies": round(self.copies, 3), "functions_loaded": self.functions, "packages": self.packages,
                "source": self.source, "first_load_s": round(self.first_load_s, 1), "first_load_source": EDGE_BENCH}


def resident(manifest: dict, plan: list[Loaded] | None = None) -> Resident:
    """What holding `plan` (default: `load_plan(manifest)`) keeps wired on the export's runtime.
    Functions are counted per package file: a single-function package is its own copy."""
    rt = runtime_of(manifest)
    plan = load_plan(manifest) if plan is None else plan
    by_file: dict[str, tuple[int, set[str]]] = {}
    for f in plan:
        weights, names = by_file.setdefault(f.file, (f.weight_bytes, set()))
        names.add(f.function_name)
    packages, total = {}, {"low": 0.0, "mid": 0.0, "high": 0.0}
    copy = 0.0
    for file, (weights, names) in by_file.items():
        wired = {case: weights * rt.factor(len(names), case) for case in total}
        for case in total:
            total[case] += wired[case]
        copy += weights * rt.factor(1)
        packages[file] = {"functions": sorted(names), "weight_bytes": weights, "resident_bytes": round(wired["mid"])}
    return Resident(rt.name, round(total["mid"]), (round(total["low"]), round(total["high"])), round(copy),
                    len(plan), packages, rt.source)


def first_load_seconds(functions: int) -> float:
    """Modelled first-load specialization of `functions` functions: the power law through the two
    published points (SPECIALIZATION_POINTS), by function count alone (the model's size and the
    chip are those of the measurement)."""
    (n0, t0), (n1, t1) = SPECIALIZATION_POINTS
    k = math.log(t1 / t0) / math.log(n1 / n0)
    return t0 * (functions / n0) ** k if functions > 0 else 0.0

