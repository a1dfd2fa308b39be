"""The output folder of an export: whether it may be written, who is writing it, and what earlier
exports left beside it (and, in the temporary directory, what the export's imports leave).

An export writes into a hidden partial folder next to OUT (`.OUT.partial-*`) and renames it to OUT
at the end. While it runs it holds a lock on OUT (the file `.OUT.lock` next to it, locked with
flock, which the kernel releases when the process ends however it ends), so a second export to the
same OUT is refused at once instead of replacing the first one's result. Each partial folder
records its owner (host, pid and the process's start time, so that a reused pid is not taken for
it); a partial folder whose owner has died (an export killed by SIGKILL or a power cut) is removed
by the next export to the same OUT.
"""

from __future__ import annotations

import contextlib
import getpass
import json
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path
from typing import Iterator

from ..errors import LlamaANEError

OWNER_FILE = ".owner.json"  # inside a partial folder; removed once the folder has become OUT


class ExportError(LlamaANEError, RuntimeError):
    """The export could not be written; the message says why and what to do."""


class OutFolderError(LlamaANEError, RuntimeError):
    """OUT cannot be written now (another export writes it); the message says which and what to do."""


def owner_record(pid: int | None = None) -> dict:
    """What identifies a running process across hosts and pid reuse."""
    import psutil

    pid = os.getpid() if pid is None else pid
    return {"host": socket.gethostname(), "pid": pid, "started": psutil.Process(pid).create_time()}


def is_running(owner: dict) -> bool:
    """Whether the process `owner` describes (see owner_record) still runs. A process of another
    host counts as running: nothing here can tell."""
    import psutil

    if owner.get("host") != socket.gethostname():
        return True
    try:
        proc = psutil.Process(int(owner["pid"]))
        return abs(proc.create_time() - float(owner["started"])) < 1 and proc.status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.AccessDenied, KeyError, TypeError, ValueError):
        return False


def describe(owner: dict) -> str:
    try:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(owner["started"])))
        return f"process {int(owner['pid'])} on {owner.get('host', '?')}, started {since}"
    except (KeyError, TypeError, ValueError):
        return "a process that has not said which yet"


def _lock_path(out: Path) -> Path:
    return out.parent / f".{out.name}.lock"


def partial_prefix(out: Path) -> str:
    return f".{out.name}.partial-"


class OutLock:
    """An exclusive lock on OUT for the length of an export (a context manager). Acquiring fails at
    once with OutFolderError naming the export that holds it. The lock file holds the owner's
    record and is removed on release; where flock does not exist, nothing is locked."""

    def __init__(self, out: Path):
        self.out, self.path, self.fd = out, _lock_path(out), None

    def __enter__(self) -> "OutLock":
        try:
            import fcntl
        except ImportError:
            return self
        while self.fd is None:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise OutFolderError(f"another export to {self.out} is running ({describe(self._holder())}); "
                                     "wait for it to finish, or choose another -o/--out") from None
            try:  # the file may have been removed by an export that released it before we locked
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if not same:
                os.close(fd)
                continue
            os.ftruncate(fd, 0)
            os.write(fd, json.dumps(owner_record()).encode())
            self.fd = fd
        return self

    def _holder(self) -> dict:
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}

    def __exit__(self, *exc) -> None:
        if self.fd is not None:
            self.path.unlink(missing_ok=True)  # while still locked: see __enter__
            os.close(self.fd)
            self.fd = None


def make_partial(out: Path) -> Path:
    """A new partial folder for OUT, with this process recorded as its owner."""
    tmp = Path(tempfile.mkdtemp(prefix=partial_prefix(out), dir=out.parent))
    (tmp / OWNER_FILE).write_text(json.dumps({**owner_record(), "out": out.name}))
    return tmp


def stale_partials(out: Path) -> list[Path]:
    """Partial folders of OUT whose owner has died. One without an owner record is left alone:
    nothing says whose it is."""
    found = []
    for folder in (p for p in out.parent.iterdir() if p.name.startswith(partial_prefix(out))):
        try:
            owner = json.loads((folder / OWNER_FILE).read_text())
        except (OSError, ValueError):
            continue
        if isinstance(owner, dict) and owner.get("out") == out.name and not is_running(owner):
            found.append(folder)
    return found


def remove_stale_partials(out: Path) -> list[Path]:
    """Remove the partial folders that exports to OUT killed before they could clean up left."""
    stale = stale_partials(out)
    for folder in stale:
        shutil.rmtree(folder, ignore_errors=True)
    return stale


def finish(tmp: Path, out: Path) -> None:
    """Put the complete partial folder `tmp` in place as OUT, replacing an earlier OUT."""
    if out.exists():
        old = out.parent / f".{out.name}.old-{int(time.time())}"
        out.rename(old)
        shutil.rmtree(old, ignore_errors=True)
    tmp.rename(out)
    (out / OWNER_FILE).unlink(missing_ok=True)


def overlap(out: Path, source: Path) -> str | None:
    """How OUT and the checkpoint `source` (a folder or a file) overlap, if they do: replacing OUT
    or writing into it would destroy the checkpoint."""
    out, source = out.resolve(), source.resolve()
    if out == source:
        return "is"
    if source in out.parents:
        return "is inside"
    if out in source.parents:
        return "contains"
    return None


def check_not_source(out: Path, source: str | Path | None) -> None:
    """Refuse an OUT that is the checkpoint, lies inside it or contains it, --force or not: the
    export would replace or write into the model it reads."""
    if source is None or not Path(source).expanduser().exists():
        return
    how = overlap(out, Path(source).expanduser())
    if how is not None:
        raise ExportError(f"-o/--out {out} {how} the checkpoint {Path(source).expanduser().resolve()}, which the "
                          "export would overwrite; choose an output folder outside the checkpoint")


def check_writable_parent(out: Path) -> None:
    """Refuse an OUT whose parent folder cannot be created or written, before any work."""
    parent = out.parent
    existing = parent
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise ExportError(f"cannot write {out}: {existing} is not a writable folder; choose another -o/--out")


@contextlib.contextmanager
def no_inductor_leftover() -> Iterator[None]:
    """Remove the empty `torchinductor_<user>` folder that importing transformers' Llama modules makes
    in the temporary directory, if it was not there before: an export leaves nothing in /tmp."""
    try:
        folder = Path(tempfile.gettempdir()) / f"torchinductor_{getpass.getuser()}"
    except (KeyError, OSError):  # no user name to build it from: torch cannot make it either
        yield
        return
    existed = folder.exists()
    try:
        yield
    finally:
        if not existed and folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()
