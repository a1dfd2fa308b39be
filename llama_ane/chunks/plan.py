"""The chunk plan: which decoder layers go into which block-chunk file."""

from __future__ import annotations

from ..config import LlamaConfig
from ..limits import file_limit_bytes


def layer_weight_bytes(cfg: LlamaConfig, bytes_per_weight: int = 2) -> int:
    """Weight bytes of one decoder layer (projections, MLP, two norms)."""
    c, q, kv, i = cfg.hidden_size, cfg.q_channels, cfg.kv_channels, cfg.intermediate_size
    params = c * q + 2 * c * kv + q * c + 3 * c * i + 2 * c
    return params * bytes_per_weight


def plan_chunks(cfg: LlamaConfig, layers_per_chunk: int | None = None, *,
                target: str = "iOS18", bytes_per_weight: int = 2) -> list[list[int]]:
    """Group layer indices into chunks.

    With `layers_per_chunk` K, chunks hold K layers and the last one the remainder (5 layers at
    K=2 -> [0,1], [2,3], [4]). Without it, K is the most layers whose weights fit the target's file
    limit (`limits.file_limit_bytes`, the one `inspect --strict` enforces), and the layers are
    spread evenly over the fewest chunks that K allows. Every layer lands in
    exactly one chunk.
    """
    n = cfg.num_hidden_layers
    if layers_per_chunk is not None:
        if layers_per_chunk < 1:
            raise ValueError(f"--layers-per-chunk must be at least 1, got {layers_per_chunk}")
        k = min(layers_per_chunk, n)
        return [list(range(s, min(s + k, n))) for s in range(0, n, k)]
    per_layer = layer_weight_bytes(cfg, bytes_per_weight)
    k = max(1, min(n, file_limit_bytes(target) // per_layer))
    count = -(-n // k)
    base, extra = divmod(n, count)
    chunks, start = [], 0
    for c in range(count):
        size = base + (1 if c < extra else 0)
        chunks.append(list(range(start, start + size)))
        start += size
    return chunks
