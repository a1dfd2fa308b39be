"""Start one process per rank with ``torch.distributed`` initialised (NCCL: one GPU per rank)."""

from __future__ import annotations

import os
import socket
from datetime import timedelta


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, fn, world: int, backend: str, port: int, args: tuple) -> None:
    import torch
    import torch.distributed as dist

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    kw = {}
    if backend == "nccl":
        torch.cuda.set_device(rank)
        kw["device_id"] = torch.device("cuda", rank)
    dist.init_process_group(backend, rank=rank, world_size=world,
                            timeout=timedelta(minutes=10), **kw)
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def spawn(fn, world: int, backend: str, args: tuple = ()) -> None:
    """Run ``fn(rank, world, *args)`` in ``world`` processes (a module-level function).

    Each process has the default group initialised (``torch.distributed.group.WORLD``); with
    ``nccl`` rank ``r`` owns ``cuda:r``. Raises if any rank fails.
    """
    import torch.multiprocessing as mp

    if backend == "nccl":
        import torch

        if torch.cuda.device_count() < world:
            raise RuntimeError(f"{world} NCCL ranks need {world} GPUs, the host has "
                               f"{torch.cuda.device_count()}")
    mp.spawn(_worker, args=(fn, world, backend, free_port(), args), nprocs=world, join=True)


def run_thread_ranks(world: int, fn, *, host_staging: bool = False, handoff: str = "unbatched",
                     timeout_s: float = 300.0) -> list:
    """``fn(transport)`` on ``world`` gloo ranks that are threads of this process.

    For checks without a process per rank (CI on a CPU, several ranks sharing one GPU with
    ``host_staging``). ``handoff`` is the transport's (the ``links`` groups are two more gloo
    groups on the same store). Returns each rank's result in rank order; re-raises the first
    error.
    """
    import threading

    import torch.distributed as dist

    from .prefill import Transport

    store = dist.HashStore()
    results, errors = [None] * world, []

    def work(rank: int) -> None:
        try:
            timeout = timedelta(seconds=timeout_s)
            group = dist.ProcessGroupGloo(store, rank, world, timeout)
            links = tuple(dist.ProcessGroupGloo(dist.PrefixStore(f"link{i}/", store), rank, world,
                                                timeout)
                          for i in range(2)) if handoff == "links" else None
            results[rank] = fn(Transport(group, host_staging=host_staging, handoff=handoff,
                                         links=links))
        except Exception as exc:  # re-raised in the caller's thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    if errors:
        raise errors[0]
    if any(t.is_alive() for t in threads):
        raise RuntimeError(f"a rank did not finish within {timeout_s:.0f} s")
    return results
