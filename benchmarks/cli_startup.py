"""How long `llama-ane --help` and each command's `--help` take, in a fresh interpreter each time (the
command line's startup: nothing but click, the command's own module and what its options need
should load; never torch, coremltools or transformers).

    python benchmarks/cli_startup.py [--repeats N] [--commands export,generate,...]

Prints one line per command line: the median and best wall time over the runs, and the heavy
modules a run of it imported (none expected). Exits 1 if any median is at or above --limit
(0.5 s) or any heavy module was imported.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("torch", "coremltools", "transformers")

# one run of the command line in-process, then the heavy modules it left imported
PROBE = """
import sys
from llama_ane.cli import main
try:
    main({args!r}, prog_name="llama-ane")
except SystemExit:
    pass
print("HEAVY=" + ",".join(m for m in {heavy!r} if m in sys.modules))
"""


def commands() -> list[str]:
    sys.path.insert(0, str(ROOT))
    from llama_ane.cli import COMMANDS

    return sorted(COMMANDS)


def heavy_imports(args: list[str]) -> list[str]:
    out = subprocess.run([sys.executable, "-c", PROBE.format(args=args, heavy=HEAVY)], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout
    line = next(line for line in out.splitlines() if line.startswith("HEAVY="))
    return [m for m in line[len("HEAVY="):].split(",") if m]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--commands", default=None, help="Comma-separated commands [default: every command].")
    parser.add_argument("--limit", type=float, default=0.5, help="Seconds a median must stay under.")
    args = parser.parse_args()
    names = args.commands.split(",") if args.commands else commands()
    ok = True
    for argv in [["--help"], *([name, "--help"] for name in names)]:
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            subprocess.run([sys.executable, "-m", "llama_ane", *argv], cwd=ROOT, check=True, capture_output=True)
            times.append(time.perf_counter() - t0)
        heavy = heavy_imports(argv)
        median = statistics.median(times)
        ok &= median < args.limit and not heavy
        print(f"llama-ane {' '.join(argv):<22} median {median:.3f} s, best {min(times):.3f} s over {args.repeats} "
              f"runs; imported {', '.join(heavy) or 'none'} of {', '.join(HEAVY)}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
