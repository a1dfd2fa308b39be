"""Memory of the machine and of a process tree: what is available, and what an export, a
verification or a benchmark used.

Resident sizes (RSS) count pages shared between a parent and its forked workers once per process,
so they overstate a process tree. The proportional set size (PSS, from `/proc/PID/smaps_rollup`)
divides each shared page among the processes mapping it: summed over a tree it counts every page
once. `PeakMemory` samples that sum in a background thread; where /proc does not exist (macOS),
it sums the tree's RSS, which spawned workers (they share little with their parent) barely
overstate. Available memory comes from psutil on every system.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

GIB = 1 << 30


def wired_bytes() -> int | None:
    """The machine's wired memory on macOS (Mach's vm_statistics64 wire count times the page size),
    where a function loaded for the Neural Engine wires its weights; None elsewhere, or where the
    kernel does not answer."""
    if sys.platform != "darwin":
        return None
    import ctypes
    import ctypes.util

    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    host_vm_info64, count = 4, 38  # HOST_VM_INFO64, HOST_VM_INFO64_COUNT (vm_statistics64 in 32-bit words)
    info, size = (ctypes.c_uint32 * count)(), ctypes.c_uint32(count)
    host = libc.mach_host_self()
    if libc.host_statistics64(host, host_vm_info64, ctypes.byref(info), ctypes.byref(size)) != 0:
        return None
    page = ctypes.c_uint64()
    if libc.host_page_size(host, ctypes.byref(page)) != 0:
        return None
    return int(info[3]) * page.value  # free, active, inactive, then wire_count


def available_bytes() -> int | None:
    """Memory a new allocation can get without swapping (psutil's `available`: MemAvailable on
    Linux, free plus inactive pages on macOS), capped by a Linux cgroup limit."""
    import psutil

    try:
        avail = int(psutil.virtual_memory().available)
    except (OSError, RuntimeError, AttributeError):
        avail = None
    limit = _cgroup_room() if sys.platform.startswith("linux") else None
    if limit is not None:
        avail = limit if avail is None else min(avail, limit)
    return avail


def _cgroup_room() -> int | None:
    """Bytes left under a cgroup v2 memory limit, if this process runs under one (Linux)."""
    base = Path("/sys/fs/cgroup")
    try:
        limit = (base / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return max(0, int(limit) - int((base / "memory.current").read_text()))
    except (OSError, ValueError):
        return None


def tree_pids(root: int) -> list[int]:
    """`root` and all its descendants."""
    import psutil

    try:
        return [root] + [p.pid for p in psutil.Process(root).children(recursive=True)]
    except psutil.Error:
        return [root]


def _rollup_bytes(pid: int, fields: tuple[str, ...]) -> int:
    """The sum of `fields` ("Pss:", ...) of one process's /proc/PID/smaps_rollup, in bytes; 0 if it
    is gone or unreadable."""
    try:
        return sum(int(line.split()[1]) * 1024
                   for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines() if line.startswith(fields))
    except (OSError, ValueError, IndexError):
        return 0


def pss_bytes(pid: int) -> int:
    """Proportional set size of one process, 0 if it is gone or unreadable."""
    return _rollup_bytes(pid, ("Pss:",))


def private_bytes(pid: int) -> int:
    """Memory only this process maps (its private pages: what it allocated or copied on write, not
    what it shares with its parent), 0 if it is gone or unreadable. Linux reads smaps_rollup;
    elsewhere psutil's unique set size."""
    if have_pss():
        return _rollup_bytes(pid, ("Private_Clean:", "Private_Dirty:"))
    import psutil

    try:
        return int(psutil.Process(pid).memory_full_info().uss)
    except (psutil.Error, AttributeError, OSError):
        return 0


def tree_pss_bytes(root: int | None = None) -> int:
    """Summed PSS of `root` (default: this process) and its descendants."""
    return sum(pss_bytes(p) for p in tree_pids(os.getpid() if root is None else root))


def have_pss() -> bool:
    """Whether PSS can be read (Linux /proc; nothing is read from /proc elsewhere)."""
    return sys.platform.startswith("linux") and Path(f"/proc/{os.getpid()}/smaps_rollup").is_file()


def tree_rss_bytes(root: int) -> int:
    """Summed RSS of `root` and its descendants (psutil; 0 for a process that is gone)."""
    import psutil

    total = 0
    for pid in tree_pids(root):
        try:
            total += int(psutil.Process(pid).memory_info().rss)
        except psutil.Error:
            pass
    return total


class PeakMemory:
    """Sample the memory of a process tree (default: this process and its children) every
    `interval` seconds; `peak` is the largest sample, and a spike shorter than the interval can slip
    between two. Use as a context manager around the work to measure. `method` says what a sample
    counts: "pss-tree", the summed PSS (Linux), or "rss-tree", the summed RSS (elsewhere: pages
    shared between the processes count once per process)."""

    def __init__(self, root: int | None = None, interval: float = 0.2):
        self.root = os.getpid() if root is None else root
        self.interval = interval
        self.peak = 0
        self.method = "pss-tree" if have_pss() else "rss-tree"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self) -> int:
        now = tree_pss_bytes(self.root) if self.method == "pss-tree" else tree_rss_bytes(self.root)
        self.peak = max(self.peak, now)
        return now

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def __enter__(self) -> "PeakMemory":
        self.sample()
        self._thread = threading.Thread(target=self._loop, name="peak-memory", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.sample()


def wait_and_sample(proc, meter: PeakMemory, poll: float = 0.2) -> int:
    """Wait for a subprocess.Popen while `meter` samples its tree; return its exit code."""
    while proc.poll() is None:
        meter.sample()
        time.sleep(poll)
    return proc.returncode


def keep_freed_memory() -> None:
    """Let this process reuse the memory it frees instead of handing it back to the system: with
    glibc, large arrays are otherwise mapped afresh each time and every page faulted in again.
    For a worker that runs many short jobs of the same size (its peak stays what one job needs).
    Does nothing where the C library is not glibc."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    if not mallopt(M_MMAP_THRESHOLD, 1 << 30):  # allocations come from the heap
        mallopt(M_MMAP_THRESHOLD, 32 << 20)  # the most some glibc versions allow
    mallopt(M_TRIM_THRESHOLD, (1 << 31) - 1)  # and what is freed stays there for the next one
