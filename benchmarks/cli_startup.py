"""How long `llama-ane --help` takes, in a fresh interpreter each time (the command line's startup:
nothing but click and the command list should load).

    python benchmarks/cli_startup.py [--repeats N]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "llama_ane", "--help"], check=True, capture_output=True)
        times.append(time.perf_counter() - t0)
    print(f"llama-ane --help: median {statistics.median(times):.3f} s, best {min(times):.3f} s "
          f"over {args.repeats} runs")


if __name__ == "__main__":
    main()
