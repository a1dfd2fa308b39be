"""Try a transformers release (the newest on the package index by default) against the family tests,
outside CI's gating run, so that a release that breaks a family's reference is found here first.

The release is installed with its own dependencies into a temporary folder put first on the path of
one pytest run; the project's environment is left as it is. The run covers, for every family:
torch fp32 logits and greedy tokens against transformers' own class, and the parity gate's
reference built from transformers' decoder layers (no export, a few minutes on two cores).

    python benchmarks/transformers_latest.py                 # the newest release
    python benchmarks/transformers_latest.py --version 5.15.0  # the floor of the declared range

Writes benchmarks/results/transformers_latest.json (or --name), with the range pyproject.toml
declares and whether the release is in it. Exits 1 when a test failed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TESTS = ["tests/test_families.py", "tests/test_architectures.py"]
SELECT = "match_the_family_class or builds_the_family_reference"  # logits, greedy tokens, the gate's reference


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()


def newest_release() -> str:
    """The newest transformers version the package index serves (pip's own answer)."""
    out = subprocess.run([sys.executable, "-m", "pip", "index", "versions", "transformers"],
                         capture_output=True, text=True, check=True).stdout
    found = re.search(r"^transformers \(([^)]+)\)", out, re.M)
    if not found:
        raise SystemExit(f"could not read the newest transformers from `pip index versions`:\n{out}")
    return found.group(1)


def declared_range() -> str:
    """The transformers requirement pyproject.toml declares, e.g. '>=5.15,<5.25'."""
    text = (ROOT / "pyproject.toml").read_text()
    found = re.search(r'"transformers([<>=!~][^"]*)"', text)
    return found.group(1) if found else ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", default=None, help="the release to try [default: the newest]")
    parser.add_argument("--name", default="transformers_latest", help="results file name (no extension)")
    args = parser.parse_args()

    from importlib import metadata

    from packaging.specifiers import SpecifierSet

    version = args.version or newest_release()
    tested = declared_range()
    target = Path(tempfile.mkdtemp(prefix="transformers-"))
    try:
        print(f"installing transformers {version} into {target} ...", flush=True)
        pins = target / "constraints.txt"  # the binary packages torch and coremltools were built against stay
        pins.write_text("".join(f"{name}=={metadata.version(name)}\n" for name in ("numpy", "torch")))
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--target", str(target / "site"),
                        "-c", str(pins), f"transformers=={version}"], check=True)
        t0 = time.perf_counter()
        env = {**os.environ, "PYTHONPATH": str(target / "site")}
        run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *TESTS, "-k", SELECT],
                             cwd=ROOT, env=env, capture_output=True, text=True)
        seconds = time.perf_counter() - t0
        check = subprocess.run([sys.executable, "-c", "import transformers; print(transformers.__version__)"],
                               env=env, capture_output=True, text=True)
    finally:
        shutil.rmtree(target, ignore_errors=True)
    ran = check.stdout.strip()
    if ran != version:
        raise SystemExit(f"the tests imported transformers {ran or '(none)'}, not {version}: {check.stderr[-500:]}")
    summary = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else run.stderr[-500:]
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|error|skipped)", summary)}
    failed = sorted(set(re.findall(r"^(?:FAILED|ERROR) (\S+)", run.stdout, re.M)))
    result = {
        "date": datetime.date.today().isoformat(),
        "commit": git("rev-parse", "--short", "HEAD") + ("-dirty" if git("status", "--porcelain", "--", "llama_ane")
                                                         else ""),
        "command": "python benchmarks/transformers_latest.py" + (f" --version {args.version}" if args.version else "")
                   + (f" --name {args.name}" if args.name != "transformers_latest" else ""),
        "rows": [{"transformers": version, "declared range": tested,
                  "in range": SpecifierSet(tested).contains(version) if tested else None,
                  "passed": counts.get("passed", 0), "failed": counts.get("failed", 0) + counts.get("error", 0),
                  "seconds": round(seconds, 1), "tests": " ".join(TESTS), "selected": SELECT}],
        "failures": failed,
    }
    out = HERE / "results" / f"{args.name}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"transformers {version} (declared {tested}): {summary}")
    for name in failed:
        print(f"  {name}")
    print(f"wrote {out.relative_to(ROOT)}")
    sys.exit(1 if run.returncode else 0)


if __name__ == "__main__":
    main()
