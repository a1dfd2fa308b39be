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
# A batch with two programs per SM is not split (every split costs a merge); smaller batches are
# split up to four per SM.
DECODE_NO_SPLIT_PER_SM = 2
DECODE_PROGRAMS_PER_SM = 4
# Two shared-prefix programs with a 128-row tile fit an SM (registers) and hide each other's
# load latency.
PREFIX_PROGRAMS_PER_SM = 2
MAX_SPLITS = 64


def prefix_block_m(n_rows: int) -> int:
    """Row tile of the shared-prefix and tree kernels: the smallest tensor-core tile (16..128,
    a power of two) that holds the rows."""
    return min(128, max(16, 1 << max(0, (n_rows - 1).bit_length())))


def consecutive_first_page(pages) -> int | None:
    """The first of ``pages`` when they are consecutive (``p0, p0 + 1, ...``), else None: such
    a prefix can be read by bulk tensor copies without its page table."""
    pages = [int(p) for p in pages]
    if not pages or any(b != a + 1 for a, b in zip(pages, pages[1:])):
        return None
    return pages[0]


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


# A shared-prefix program alone on its SM, next to decode programs, runs at this fraction of the
# rate of two prefix programs sharing one: fitted to the H100 timings of the overlap schedule at
# prefix 32768, batch 256, suffix 128 (benchmarks/results/cuda_notes.md).
PREFIX_SOLO_RATE = 0.58


def overlap_time(programs: int, prefix_s: float, suffix_s: float, num_sms: int) -> float:
    """Modelled seconds of the prefix kernel (``programs`` equal programs, ``prefix_s`` seconds of
    work when every SM runs two of them) next to the suffix decode (``suffix_s`` seconds on the
    whole GPU), for ``programs <= 2 * num_sms`` (one wave).

    The first ``num_sms`` programs take one SM each, the rest a second slot on as many SMs. Two
    programs fill an SM's registers, so the decode runs only on SMs with one (at half an SM until
    that program ends, then a whole SM) or none, and on every SM once the prefix is done.
    """
    if not 0 < programs <= 2 * num_sms:
        raise ValueError(f"overlap_time models one wave of 1..{2 * num_sms} programs, got {programs}")
    work = prefix_s * num_sms / programs            # one program's work, in SM-seconds
    doubled = max(0, programs - num_sms)            # SMs running two programs
    single = min(programs, num_sms) - doubled       # SMs running one
    idle = num_sms - doubled - single
    t_double = 2 * work if doubled else 0.0
    t_single = work / PREFIX_SOLO_RATE if single else 0.0
    prefix_end = max(t_double, t_single)
    capacity = idle * prefix_end + single * (0.5 * t_single + (prefix_end - t_single))
    return prefix_end + max(0.0, suffix_s * num_sms - capacity) / num_sms


def choose_overlap_prefix_splits(n_rows: int, block_m: int, num_kv_heads: int, prefix_len: int,
                                 num_sms: int, prefix_s: float, suffix_s: float) -> tuple[int, int]:
    """``(splits, chunk_len)`` of the prefix kernel when it runs next to the suffix decode.

    Fewer programs than two per SM leave SMs with a free half for the decode: worth it when the
    suffixes are a large share of the work (MHA), not when they are small (GQA). Candidates are
    the split counts that give every SM one or two programs, modelled by :func:`overlap_time`, and
    the standalone choice, modelled as the prefix then the decode. Fewer programs than SMs are not
    tried: they leave SMs idle and measure far slower than any such model predicts.
    """
    standalone = choose_prefix_splits(n_rows, block_m, num_kv_heads, prefix_len, num_sms)
    units = _cdiv(max(n_rows, 1), block_m) * num_kv_heads
    best = (prefix_s + suffix_s, standalone[0])
    max_s = max(1, min(MAX_SPLITS, prefix_len // MIN_PREFIX_CHUNK))
    for s in range(1, max_s + 1):
        if units * s > PREFIX_PROGRAMS_PER_SM * num_sms:
            break
        if units * s <= num_sms:
            continue
        best = min(best, (overlap_time(units * s, prefix_s, suffix_s, num_sms), s))
    return choose_prefix_splits(n_rows, block_m, num_kv_heads, prefix_len, num_sms, best[1])
