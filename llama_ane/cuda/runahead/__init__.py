"""KV-Runahead: parallel prefill of one long prompt across processes (``torch.distributed``).

* ``prefill``    :func:`runahead_prefill` (per-layer point-to-point K/V chain, causal offset),
                 :func:`sequence_parallel_prefill` (all-gather baseline), :func:`single_prefill`
* ``attention``  the slab's causal-offset attention: torch mask, torch flash, or the project's
                 shared-prefix kernel + flash + merge
* ``partition``  bounds, the hierarchical grid search, the lookup table
* ``launch``     one process per rank (NCCL on GPUs, gloo on the CPU)
* ``model``      an engine with random weights in a real model's shapes (timing)
"""

from .partition import (PartitionTable, even_bounds, hierarchical_grid_search)  # noqa: F401
from .prefill import (PrefillResult, Transport, runahead_prefill,  # noqa: F401
                      sequence_parallel_prefill, single_prefill)
