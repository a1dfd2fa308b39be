"""An export stopped or killed mid-way, two exports to one folder, an OUT that would overwrite the
checkpoint, and the memory an export plans with on macOS.

The kill tests run the real command line, `python SCRIPT export ...`, where SCRIPT replaces
build_package with one that records its worker's pid and then blocks: the export is caught with
its workers running, every time. (A spawned worker runs SCRIPT as its main module too, so it
blocks as well.) After a stop signal the export must exit non-zero with one line, stop its
workers and leave nothing; after SIGKILL its workers must still end, by the parent-death signal
or, as on macOS, by their watch on the parent; an earlier export at OUT survives either way.
"""

from __future__ import annotations

import builtins
import hashlib
import io
import json
import os
import pathlib
import platform
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from click.testing import CliRunner

from llama_ane.api import export_model
from llama_ane.cli import main
from llama_ane import memory
from llama_ane.export import convert
from llama_ane.export.out_folder import (OWNER_FILE, OutFolderError, OutLock, make_partial, owner_record,
                                         remove_stale_partials)

ROOT = Path(__file__).resolve().parent.parent
OPTIONS = ["--layers-per-chunk", "1", "--context-length", "64", "--prefill-length", "32", "--no-verify", "--quiet"]

NO_FORK_ON_MACOS = pytest.mark.skipif(sys.platform == "darwin", reason="fork after importing torch is unsafe on macOS")

BLOCKING_EXPORT = '''
import os, sys, time
from llama_ane.export import convert

def blocked_build(*args, **kwargs):
    with open(os.path.join(os.environ["EXPORT_FAULTS_PIDS"], str(os.getpid())), "w") as f:
        f.write(str(os.getppid()))
    time.sleep(600)

convert.build_package = blocked_build

if __name__ == "__main__":
    from llama_ane.cli import main
    main(sys.argv[1:], prog_name="llama-ane")
'''


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint) -> Path:
    return Path(tiny_checkpoint(num_hidden_layers=2))


@pytest.fixture(scope="module")
def good_export(checkpoint, tmp_path_factory) -> Path:
    """An export to copy to OUT before a --force export that is then killed."""
    return export_model(checkpoint, tmp_path_factory.mktemp("good") / "out", layers_per_chunk=1, context_length=64,
                        prefill_length=32, progress=False, verify=False)


def tree_digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def running(pid: int) -> bool:
    """Whether `pid` runs (a zombie waiting for a reaper that never comes does not)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


class BlockingExport:
    """`llama-ane export CHECKPOINT -o OUT --force --workers 2` with blocking builds, in a session of its own."""

    def __init__(self, tmp: Path, checkpoint: Path, out: Path, **env: str):
        self.pids = tmp / "pids"
        self.pids.mkdir()
        script = tmp / "blocking_export.py"
        script.write_text(BLOCKING_EXPORT)
        environ = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONWARNINGS="ignore", EXPORT_FAULTS_PIDS=str(self.pids),
                       **env)
        self.proc = subprocess.Popen([sys.executable, str(script), "export", str(checkpoint), "-o", str(out),
                                      "--force", "--workers", "2", *OPTIONS],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environ,
                                     cwd=ROOT, start_new_session=True)

    def workers(self) -> list[int]:
        return [int(p.name) for p in self.pids.iterdir()]

    def wait_for_workers(self, timeout: float = 300) -> list[int]:
        end = time.monotonic() + timeout
        while len(self.workers()) < 2:
            assert self.proc.poll() is None, self.proc.communicate()[1][-3000:]
            assert time.monotonic() < end, "the export never started its workers"
            time.sleep(0.05)
        assert all(int((self.pids / str(w)).read_text()) == self.proc.pid for w in self.workers())
        return self.workers()

    def finish(self, timeout: float = 120) -> tuple[str, str]:
        return self.proc.communicate(timeout=timeout)

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.communicate()
        for pid in self.workers():  # never leave a blocked worker behind, whatever the test found
            if running(pid):
                os.kill(pid, signal.SIGKILL)


def assert_workers_end(pids: list[int], timeout: float = 20) -> None:
    end = time.monotonic() + timeout
    while any(running(p) for p in pids) and time.monotonic() < end:
        time.sleep(0.05)
    assert not [p for p in pids if running(p)], "a worker outlived its export"


@pytest.fixture
def earlier(good_export, tmp_path) -> tuple[Path, dict]:
    """OUT holding a complete earlier export, and its files' digests."""
    out = tmp_path / "work" / "out"
    shutil.copytree(good_export, out)
    return out, tree_digest(out)


@pytest.mark.export
@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 1), (signal.SIGTERM, 128 + signal.SIGTERM)],
                         ids=["SIGINT", "SIGTERM"])
def test_a_stop_signal_stops_the_workers_and_leaves_nothing(checkpoint, earlier, tmp_path, signum, code):
    out, before = earlier
    export = BlockingExport(tmp_path, checkpoint, out)
    try:
        workers = export.wait_for_workers()
        os.kill(export.proc.pid, signum)  # the export alone: it must stop its workers itself
        stdout, stderr = export.finish()
    finally:
        export.close()
    assert export.proc.returncode == code, stderr[-3000:]
    assert "Traceback" not in stdout + stderr, stderr[-3000:]
    if signum != signal.SIGINT:
        assert [line for line in stderr.splitlines() if line.startswith("Error:")] == [
            f"Error: the export was stopped by SIGTERM; nothing was written to {out}"]
    assert_workers_end(workers, timeout=5)
    assert sorted(p.name for p in out.parent.iterdir()) == ["out"]  # no partial folder, no lock file
    assert tree_digest(out) == before


@pytest.mark.export
def test_a_second_export_to_the_same_out_is_refused_while_the_first_runs(checkpoint, earlier, tmp_path):
    """The second fails at once naming the first; the first then ends by SIGHUP, as when its
    terminal closes, and cleans up as after Ctrl-C."""
    out, before = earlier
    export = BlockingExport(tmp_path, checkpoint, out)
    try:
        workers = export.wait_for_workers()
        second = subprocess.run([sys.executable, "-m", "llama_ane", "export", str(checkpoint), "-o", str(out),
                                 "--force", *OPTIONS], capture_output=True, text=True, cwd=ROOT, timeout=300,
                                env=dict(os.environ, PYTHONPATH=str(ROOT), PYTHONWARNINGS="ignore"))
        assert export.proc.poll() is None and all(running(w) for w in workers)
        os.kill(export.proc.pid, signal.SIGHUP)
        stdout, stderr = export.finish()
    finally:
        export.close()
    assert second.returncode == 1, second.stderr[-3000:]
    assert "Traceback" not in second.stdout + second.stderr
    errors = [line for line in second.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and errors[0].startswith(
        f"Error: another export to {out} is running (process {export.proc.pid} on "), second.stderr[-3000:]
    assert errors[0].endswith("wait for it to finish, or choose another -o/--out")
    assert export.proc.returncode == 128 + signal.SIGHUP and "Traceback" not in stderr, stderr[-3000:]
    assert_workers_end(workers, timeout=5)
    assert sorted(p.name for p in out.parent.iterdir()) == ["out"]
    assert tree_digest(out) == before


@pytest.mark.export
@pytest.mark.parametrize("method, pdeathsig", [
    pytest.param("fork", "1", id="fork", marks=NO_FORK_ON_MACOS),
    pytest.param("fork", "0", id="fork-watch-only", marks=NO_FORK_ON_MACOS),
    pytest.param("spawn", "0", id="spawn-watch-only")])
def test_workers_of_a_killed_export_end_and_its_partial_folder_goes_with_the_next_export(
        checkpoint, earlier, tmp_path, method, pdeathsig):
    """SIGKILL gives the export no chance to clean up: its workers end by themselves (the
    parent-death signal, or with it off the watch every worker keeps on its parent, which is what
    macOS has), the earlier export at OUT is intact, and the partial folder left behind is removed
    by the next export to OUT."""
    out, before = earlier
    export = BlockingExport(tmp_path, checkpoint, out, LLAMA_ANE_START_METHOD=method, LLAMA_ANE_PDEATHSIG=pdeathsig)
    try:
        workers = export.wait_for_workers()
        os.kill(export.proc.pid, signal.SIGKILL)
        export.finish()
        assert_workers_end(workers)
    finally:
        export.close()
    left = [p.name for p in out.parent.iterdir() if p.name != "out"]
    assert any(name.startswith(".out.partial-") for name in left), left
    assert tree_digest(out) == before
    if method != convert.start_method() or pdeathsig != ("1" if method == "fork" else "0"):
        return  # the next export runs once: after the kill of an export started the default way
    files = json.loads((out / "manifest.json").read_text())["files"]
    export_model(checkpoint, out, force=True, layers_per_chunk=1, context_length=64, prefill_length=32, progress=False, verify=False)
    assert sorted(p.name for p in out.parent.iterdir()) == ["out"]  # the partial folder and the lock gone
    assert json.loads((out / "manifest.json").read_text())["files"] == files
    assert not (out / OWNER_FILE).exists()


@pytest.mark.export
def test_spawned_workers_build_the_same_packages_as_forked_ones(checkpoint, good_export, tmp_path):
    """good_export's workers started the default way (fork, except on macOS); these spawn."""
    from llama_ane.checkpoint.loader import load_checkpoint
    from llama_ane.contract.manifest import sha256_path
    from llama_ane.contract.plan import ExportOptions, plan_export

    ckpt = load_checkpoint(checkpoint)
    plan = plan_export(ckpt.config, ExportOptions(context_length=64, prefill_length=32, layers_per_chunk=1))
    convert.convert_all(plan, ckpt, tmp_path, workers=2, method="spawn")
    forked = json.loads((good_export / "manifest.json").read_text())["files"]
    assert {spec.file: sha256_path(tmp_path / spec.file) for spec in plan.packages} == \
        {spec.file: forked[spec.file] for spec in plan.packages}


# --- OUT and the checkpoint ------------------------------------------------------------------------

def refused(args: list[str], source: Path) -> str:
    """Run `llama-ane export ARGS --force` in-process; the one Error line, after checking that the
    source is exactly as it was."""
    before = tree_digest(source) if source.is_dir() else hashlib.sha256(source.read_bytes()).hexdigest()
    result = CliRunner().invoke(main, ["export", *map(str, args), "--force", "--quiet"])
    after = tree_digest(source) if source.is_dir() else hashlib.sha256(source.read_bytes()).hexdigest()
    assert after == before
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, result.output
    return errors[0]


@pytest.mark.parametrize("where, how", [(".", "is"), ("sub/out", "is inside"), ("..", "contains")])
def test_out_overlapping_a_checkpoint_folder_is_refused(checkpoint, tmp_path, where, how):
    source = tmp_path / "parent" / "model"
    shutil.copytree(checkpoint, source)
    out = (source / where).resolve()
    line = refused([source, "-o", out], source)
    assert f"{out} {how} the checkpoint {source}" in line and "outside the checkpoint" in line


@pytest.mark.parametrize("where, how", [("model.gguf", "is"), (".", "contains")])
def test_out_overlapping_a_gguf_checkpoint_is_refused(tmp_path, where, how):
    source = tmp_path / "model.gguf"
    source.write_bytes(b"GGUF not read: refused before")
    out = (tmp_path / where).resolve()
    line = refused([source, "-o", out], source)
    assert f"{out} {how} the checkpoint {source}" in line


# --- the lock and the owner records -----------------------------------------------------------------

def test_the_lock_on_out_refuses_a_second_holder_and_goes_with_the_first(tmp_path):
    out = tmp_path / "out"
    with OutLock(out):
        with pytest.raises(OutFolderError, match=f"another export to {out} is running \\(process {os.getpid()} "):
            with OutLock(out):
                pass
    assert list(tmp_path.iterdir()) == []
    with OutLock(out):  # free again
        assert json.loads((tmp_path / ".out.lock").read_text())["pid"] == os.getpid()


def test_only_partial_folders_of_dead_owners_are_removed(tmp_path):
    out = tmp_path / "out"
    mine = make_partial(out)
    dead = make_partial(out)
    record = json.loads((dead / OWNER_FILE).read_text())
    (dead / OWNER_FILE).write_text(json.dumps({**record, "started": record["started"] - 3600}))  # the pid, reused
    unowned = tmp_path / ".out.partial-unowned"
    unowned.mkdir()
    other = make_partial(tmp_path / "out.partial-a")  # another OUT's, though its name starts as OUT's do
    (other / OWNER_FILE).write_text(json.dumps({**owner_record(), "started": 0.0, "out": "out.partial-a"}))
    assert remove_stale_partials(out) == [dead]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([mine.name, unowned.name, other.name])


def test_stop_signals_wait_for_the_check_and_an_ignored_one_stays_ignored():
    """Inside the worker loop a stop signal only marks itself; the check raises it (Stopped for
    SIGTERM, a KeyboardInterrupt). A SIGHUP ignored as under nohup is not taken over."""
    hup, term = signal.signal(signal.SIGHUP, signal.SIG_IGN), signal.getsignal(signal.SIGTERM)
    reached = False
    try:
        with pytest.raises(convert.Stopped) as stopped:
            with convert.deferred_signals():
                os.kill(os.getpid(), signal.SIGHUP)
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.05)
                reached = True
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN and signal.getsignal(signal.SIGTERM) is term
    finally:
        signal.signal(signal.SIGHUP, hup)
    assert reached and stopped.value.signum == signal.SIGTERM and isinstance(stopped.value, KeyboardInterrupt)


def test_start_method_from_the_environment_is_checked(monkeypatch):
    monkeypatch.setenv(convert.START_METHOD_ENV, "spawn")
    assert convert.start_method() == "spawn"
    monkeypatch.setenv(convert.START_METHOD_ENV, "threads")
    with pytest.raises(convert.ConversionError, match="LLAMA_ANE_START_METHOD='threads'"):
        convert.start_method()
    monkeypatch.delenv(convert.START_METHOD_ENV)
    monkeypatch.setattr(sys, "platform", "darwin")
    assert convert.start_method() == "spawn"


# --- memory on macOS ---------------------------------------------------------------------------------

def test_memory_on_macos_reads_nothing_from_proc(monkeypatch):
    """With the platform mocked as macOS, available memory and the meter's samples are psutil's
    (here a stand-in for its macOS calls, since Linux's psutil reads /proc) and no /proc path is touched."""
    touched = []

    def guard(real):
        def guarded(path, *args, **kwargs):
            if str(path).startswith("/proc"):
                touched.append(str(path))
                raise FileNotFoundError(path)
            return real(path, *args, **kwargs)
        return guarded
    for owner, name in ((builtins, "open"), (io, "open"), (os, "open"), (os, "stat")):
        monkeypatch.setattr(owner, name, guard(getattr(owner, name)))
    for name in ("read_text", "is_file", "exists"):
        monkeypatch.setattr(pathlib.Path, name, guard(getattr(pathlib.Path, name)))
    monkeypatch.setattr(sys, "platform", "darwin")
    monkeypatch.setattr(platform, "system", lambda: "Darwin")

    class Virtual:
        available = 7 << 30
    monkeypatch.setattr(psutil, "virtual_memory", lambda: Virtual)

    class Process:
        def __init__(self, pid):
            self.pid = pid

        def children(self, recursive):
            return []

        def memory_info(self):
            return type("Info", (), {"rss": 3 << 20})
    monkeypatch.setattr(psutil, "Process", Process)
    assert memory.available_bytes() == 7 << 30
    assert not memory.have_pss()
    with memory.PeakMemory(interval=0.01) as meter:
        time.sleep(0.05)
    assert meter.method == "rss-tree" and meter.peak == 3 << 20
    assert touched == []
