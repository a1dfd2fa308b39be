"""KV-Runahead: parallel prefill of one long prompt across processes (``torch.distributed``).

* ``prefill``    :func:`runahead_prefill` (per-layer point-to-point K/V chain, causal offset; the
                 hand-offs of :data:`HANDOFFS`), :func:`sequence_parallel_prefill` (all-gather
                 baseline, even or zigzag slabs), :func:`single_prefill`,
                 :func:`greedy_after_prefill` (a decode on any device, for checks)
* ``attention``  the slab's causal-offset attention: torch mask, torch flash, or the project's
                 shared-prefix kernel + flash + merge
* ``partition``  bounds, sequence-parallel spans, the hierarchical grid search, the lookup table,
                 the rank cost model
* ``launch``     one process per rank (NCCL on GPUs, gloo on the CPU)
* ``model``      an engine with random weights in a real model's shapes (timing)
"""

from .partition import (PartitionTable, even_bounds, hierarchical_grid_search,  # noqa: F401
                        sequence_parallel_spans)
from .prefill import (HANDOFFS, PrefillResult, Transport, greedy_after_prefill,  # noqa: F401
                      runahead_prefill, sequence_parallel_prefill, single_prefill)
