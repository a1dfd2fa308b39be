"""How many KV splits a launch uses: enough programs to fill the GPU, few enough to merge cheaply.

Pure Python (no torch, no triton) so that the choices are testable on any machine.
"""

from __future__ import annotations

# Below this many tokens per split the merge and the per-program start-up cost more than the
# parallelism gains.
MIN_DECODE_CHUNK = 256
MIN_PREFIX_CHUNK = 256
DECODE_BLOCK_N = 64
PREFIX_BLOCK_N = 64
# Decode programs are small (4 warps, little shared memory) and several stay resident per SM.
# A batch with two programs per SM is not split (every split costs a merge: run 4, 64 x 4096 GQA
# split in two, 75% of peak against 86% unsplit); smaller batches are split up to four per SM
# (run 5: 1024/16/128 GQA 0.0233 ms with 4 splits, 0.0252 with 2).
DECODE_NO_SPLIT_PER_SM = 2
DECODE_PROGRAMS_PER_SM = 4
# Two shared-prefix programs with a 128-row tile fit an SM (registers) and hide each other's
# load latency: run 2 measured 0.395 ms with 256 programs against 0.611 ms with 128.
PREFIX_PROGRAMS_PER_SM = 2
MAX_SPLITS = 64


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _round_up(a: int, b: int) -> int:
    return _cdiv(a, b) * b


def choose_decode_splits(batch: int, num_kv_heads: int, max_seq_len: int, num_sms: int,
                         num_splits: int | None = None) -> tuple[int, int]:
    """Return ``(splits, chunk_len)`` for paged decode.

    ``chunk_len`` is a multiple of the kernel's key block, and ``splits * chunk_len`` covers
    ``max_seq_len``.
    """
    max_seq_len = max(int(max_seq_len), 1)
    if num_splits is None:
        programs = max(batch * num_kv_heads, 1)
        want = 1 if programs >= DECODE_NO_SPLIT_PER_SM * num_sms else \
            _cdiv(DECODE_PROGRAMS_PER_SM * num_sms, programs)
        num_splits = max(1, min(want, max_seq_len // MIN_DECODE_CHUNK, MAX_SPLITS))
    chunk = _round_up(_cdiv(max_seq_len, num_splits), DECODE_BLOCK_N)
    return _cdiv(max_seq_len, chunk), chunk


def choose_prefix_splits(n_rows: int, block_m: int, num_kv_heads: int, prefix_len: int,
                         num_sms: int, num_splits: int | None = None) -> tuple[int, int]:
    """Return ``(splits, chunk_len)`` for the shared-prefix kernel.

    Minimises the modelled time ``waves(splits) * key blocks per split`` plus a small per-split
    merge cost: the tail of the last wave is what leaves SMs idle.
    """
    prefix_len = max(int(prefix_len), 1)
    if num_splits is None:
        row_blocks = _cdiv(max(n_rows, 1), block_m)
        slots = PREFIX_PROGRAMS_PER_SM * num_sms
        best = None
        max_s = max(1, min(MAX_SPLITS, prefix_len // MIN_PREFIX_CHUNK))
        for s in range(1, max_s + 1):
            blocks = _cdiv(_cdiv(prefix_len, s), PREFIX_BLOCK_N)
            waves = _cdiv(row_blocks * num_kv_heads * s, slots)
            cost = waves * blocks + 2 * s  # 2 blocks' worth per split: partial write + merge
            if best is None or cost < best[0]:
                best = (cost, s)
        num_splits = best[1]
    chunk = _round_up(_cdiv(prefix_len, num_splits), PREFIX_BLOCK_N)
    return _cdiv(prefix_len, chunk), chunk

