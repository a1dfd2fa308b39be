"""Per-call choice between the cascade (prefix once + suffix decode + merge) and plain decode.

A roofline model with four measured constants. Plain decode streams every request's whole KV, but
the requests read the same prefix pages at about the same time, so all but the first read of the
prefix come from L2 at ``l2_bytes_per_s``. The cascade reads the prefix once in a tensor-core
kernel (bounded by its bytes or its flops), streams the suffixes, and pays two more launches and
the fp32 partial states. Small prefixes or small batches make the extra launches cost more than
they save; long shared prefixes make plain decode re-read the prefix once per request.

Pure Python: testable anywhere, and cheap enough to run on every call.
"""

from __future__ import annotations

from dataclasses import dataclass

from .splits import choose_decode_splits, choose_prefix_splits, prefix_block_m


@dataclass(frozen=True)
class CostModel:
    """Constants fitted to a measured H100 80GB grid (how: benchmarks/results/cuda_notes.md);
    ``launch_s`` absorbs every fixed per-launch cost, start-up, tail and merge included.

    hbm_bytes_per_s : achieved streaming rate of the decode kernel
    l2_bytes_per_s : rate of prefix re-reads that hit L2 in plain decode
    tc_flops : achieved rate of the shared-prefix kernel's matrix products
    launch_s : GPU-timeline cost of one extra kernel launch (start-up and tail)

    The methods that model split-KV launches take the device's multiprocessor count ``num_sms``
    (``ops.num_sms(device)``); the constants themselves do not depend on it.
    """

    hbm_bytes_per_s: float = 3.0e12
    l2_bytes_per_s: float = 6.0e12
    tc_flops: float = 4.0e14
    launch_s: float = 12e-6

    def decode_time(self, batch: int, prefix_len: int, suffix_len: float, num_qo_heads: int,
                    num_kv_heads: int, head_dim: int, elem_bytes: int = 2, *,
                    num_sms: int) -> float:
        """Modelled seconds of plain paged decode over prefix + suffix for every request."""
        tok = 2 * num_kv_heads * head_dim * elem_bytes
        unique = (prefix_len + batch * suffix_len) * tok
        reread = max(batch - 1, 0) * prefix_len * tok
        splits, _ = choose_decode_splits(batch, num_kv_heads, int(prefix_len + suffix_len),
                                         num_sms)
        merge = 0.0
        if splits > 1:
            merge = self.launch_s + 2 * batch * splits * num_qo_heads * head_dim * 4 \
                / self.hbm_bytes_per_s
        return self.launch_s + unique / self.hbm_bytes_per_s + reread / self.l2_bytes_per_s + merge

    def prefix_time(self, batch: int, prefix_len: int, num_qo_heads: int, num_kv_heads: int,
                    head_dim: int, elem_bytes: int = 2) -> float:
        """Modelled seconds of the shared-prefix kernel alone: its bytes or its flops."""
        tok = 2 * num_kv_heads * head_dim * elem_bytes
        rows = batch * (num_qo_heads // num_kv_heads)
        block_m = prefix_block_m(rows)
        padded_rows = -(-rows // block_m) * block_m
        flops = 4.0 * padded_rows * num_kv_heads * prefix_len * head_dim
        return max(prefix_len * tok / self.hbm_bytes_per_s, flops / self.tc_flops)

    def suffix_time(self, batch: int, suffix_len: float, num_kv_heads: int, head_dim: int,
                    elem_bytes: int = 2) -> float:
        """Modelled seconds of the paged decode over every request's own suffix."""
        return batch * suffix_len * 2 * num_kv_heads * head_dim * elem_bytes / self.hbm_bytes_per_s

    def cascade_time(self, batch: int, prefix_len: int, suffix_len: float, num_qo_heads: int,
                     num_kv_heads: int, head_dim: int, elem_bytes: int = 2, *,
                     num_sms: int) -> float:
        """Modelled seconds of the three-launch cascade."""
        rows = batch * (num_qo_heads // num_kv_heads)
        block_m = prefix_block_m(rows)
        prefix = self.prefix_time(batch, prefix_len, num_qo_heads, num_kv_heads, head_dim,
                                  elem_bytes)
        suffix = self.suffix_time(batch, suffix_len, num_kv_heads, head_dim, elem_bytes)
        sp, _ = choose_prefix_splits(rows, block_m, num_kv_heads, prefix_len, num_sms)
        ss, _ = choose_decode_splits(batch, num_kv_heads, int(suffix_len), num_sms)
        states = 2 * batch * (sp + ss) * num_qo_heads * head_dim * 4  # fp32 write + read
        return 3 * self.launch_s + prefix + suffix + states / self.hbm_bytes_per_s

    def choose(self, batch: int, prefix_len: int, suffix_len: float, num_qo_heads: int,
               num_kv_heads: int, head_dim: int, elem_bytes: int = 2, *, num_sms: int) -> str:
        """``"cascade"`` or ``"decode"``, whichever the model says is faster on a GPU of
        ``num_sms`` multiprocessors."""
        args = (batch, prefix_len, suffix_len, num_qo_heads, num_kv_heads, head_dim, elem_bytes)
        faster = self.cascade_time(*args, num_sms=num_sms) < self.decode_time(*args,
                                                                              num_sms=num_sms)
        return "cascade" if faster else "decode"


DEFAULT_COST_MODEL = CostModel()

