"""Every limit an export is held to, in one place: the planner, the exporter, `inspect` and the
manifest checks all read them from here.

- MAX_DIM: the ANE rejects an op with a dimension above 16384 (the LM head is split over the
  vocabulary to stay under it).
- CACHE_MULTIPLE: cache and state dimensions are multiples of 32, or Core ML leaves them off the ANE.
- FILE_LIMIT_BYTES: the largest package a device loads comfortably, ~1 GB on iOS and ~2 GB on
  macOS, and 0.7 GB for a Core AI asset (Core AI programs of 1.1 GB and more were reported to panic
  the kernel on M6, while 0.5-0.7 GB chunks ran for thousands of calls: Anemll Forge, Sept 2026);
  `inspect --strict` rejects a package over it. The planner fills each package with at most
  `weight_budget(target)` bytes of weights: the limit less PROGRAM_BYTES, the room a package needs
  for its program and the weight blob's headers (a 3-function, 8-layer chunk's program is 0.7 MB).
- COREAI_OUTPUT_LIMIT_BYTES: the outputs one process takes from Core AI's runtime before the coreai
  backend refuses to run more: coreai-core 1.0.0b3 keeps every output buffer it allocates
  (docs/coreai.md), so a process's memory grows by what it receives; past this a restart is
  cheaper than the memory.
- MAX_FUNCTIONS_PER_PACKAGE: the functions one package of weights may hold. Each function is
  compiled and loaded on the device (its own program, specialized for the Neural Engine, even where
  the weights are shared), so load time and memory grow with them; 13 holds the default export of
  the longest context (six context buckets' prefill and decode functions and a cascade function).
  --context-buckets, --branches and --verify-window add functions.
"""

from __future__ import annotations

from .precision import PRECISIONS

MAX_DIM = 16384
CACHE_MULTIPLE = 32
FILE_LIMIT_BYTES = {"iOS": 1_000_000_000, "macOS": 2_000_000_000, "Core AI": 700_000_000}
PROGRAM_BYTES = 4_000_000
MAX_FUNCTIONS_PER_PACKAGE = 13
COREAI_OUTPUT_LIMIT_BYTES = 4 * 2**30

# Core ML ArrayFeatureType codes and MIL dtype names -> the names the manifest uses
COREML_ARRAY_DTYPES = {65568: "float32", 65552: "float16", 131104: "int32"}
PRECISION_DTYPES = {name: p.dtype for name, p in PRECISIONS.items()}
BYTES_PER_WEIGHT = {name: p.bytes for name, p in PRECISIONS.items()}


def platform_of(target: str) -> str:
    """"iOS" or "macOS" for a deployment target such as "iOS18" or "macOS15"; "Core AI" for "coreai"."""
    if target.lower() == "coreai":
        return "Core AI"
    return "macOS" if target.lower().startswith("macos") else "iOS"


def file_limit_bytes(target: str) -> int:
    """The package size limit of a deployment target."""
    return FILE_LIMIT_BYTES[platform_of(target)]


def weight_budget(target: str) -> int:
    """The weight bytes one package of a deployment target may hold."""
    return file_limit_bytes(target) - PROGRAM_BYTES
