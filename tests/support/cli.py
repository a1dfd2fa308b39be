"""The command line's failures as a user meets them: one `Error:` line naming the problem, no traceback,
and no output folder that looks complete; in-process (click's Result) or in a process of its own."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository


def assert_one_error_line(result, *words: str) -> str:
    """A non-zero exit, no traceback, one `Error: ...` line on stderr naming the problem."""
    assert result.exit_code != 0
    err = result.stderr.strip()
    assert "Traceback" not in err + result.stdout
    error_lines = [line for line in err.splitlines() if line.startswith("Error:")]
    assert len(error_lines) == 1, err
    for w in words:
        assert w in error_lines[0], (w, error_lines[0])
    return error_lines[0]


def run_cli(args: list, tmpdir: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -m llama_ane ARGS` in a process of its own, with `tmpdir` as its TMPDIR."""
    tmpdir.mkdir(exist_ok=True)
    env = dict(os.environ, TMPDIR=str(tmpdir), PYTHONPATH=str(ROOT), PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, "-m", "llama_ane", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)


def assert_nothing_left_looking_complete(tmp: Path) -> None:
    for manifest in tmp.rglob("manifest.json"):
        assert manifest.parent.name == "export", f"{manifest} was written"  # the copied input only
    partial = [p.name for p in tmp.rglob("*") if ".partial-" in p.name or ".old-" in p.name]
    assert partial == []


def assert_clear_error(proc: subprocess.CompletedProcess, words: list[str], code: int) -> None:
    """`proc` exited with `code`, no traceback, one `Error:` line on stderr holding each of `words`."""
    both = proc.stdout + proc.stderr
    assert proc.returncode == code, both[-3000:]
    assert "Traceback" not in both, both[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    for word in words:
        assert word in errors[0], (word, errors[0])
