"""Memory of a process decoding with the coreai backend: PSS every 200 steps of a 2000-step greedy
decode of a tiny random Llama exported with --target coreai (fp32), once with each cache kind,
beside the bytes the runtime returned (which it keeps: docs/coreai.md).

    python benchmarks/coreai_memory.py            # writes benchmarks/results/coreai_memory.json

Each kind runs in a process of its own; the export is made in a temporary folder and removed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
STEPS, EVERY = 2000, 200

CHILD = """
import gc, json, sys
import numpy as np, psutil
import llama_ane
from llama_ane.runtime.backends.coreai_backend import received_bytes
model = llama_ane.load(sys.argv[1], backend="coreai", output_limit_bytes=2**62)
pipe, proc = model.pipeline, psutil.Process()
pipe.reset()
pipe.prefill([5, 6, 7])
rows = []
for step in range(1, int(sys.argv[2]) + 1):
    pipe.run_window(np.array([5 + step % 200]))
    if step % int(sys.argv[3]) == 0:
        pipe.wait()
        gc.collect()
        rows.append({"step": step, "pss_mb": round(proc.memory_full_info().pss / 1e6, 1),
                     "received_mb": round(received_bytes() / 1e6, 1)})
model.close()
print(json.dumps(rows))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=STEPS)
    args = parser.parse_args()
    from llama_ane.api import export_model
    from llama_ane.testing import make_tiny_checkpoint

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True, text=True).stdout.strip()
    result = {"date": datetime.date.today().isoformat(), "commit": commit,
              "command": "python benchmarks/coreai_memory.py", "rows": []}
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = make_tiny_checkpoint(Path(tmp) / "ckpt", num_hidden_layers=2, head_dim=32,
                                    max_position_embeddings=4096)
        for kind in ("inputs", "state"):
            out = export_model(ckpt, Path(tmp) / kind, target="coreai", precision="fp32", kv_cache=kind,
                               context_length=2048 + 64, prefill_length=32, branch_width=0, progress=False,
                               verify=False)
            run = subprocess.run([sys.executable, "-c", CHILD, str(out), str(args.steps), str(EVERY)],
                                 capture_output=True, text=True, check=True)
            rows = json.loads(run.stdout.strip().splitlines()[-1])
            first, last = rows[0], rows[-1]
            for r in rows:
                result["rows"].append({"kv_cache": kind, **r})
            print(f"{kind}: PSS {first['pss_mb']} MB at step {first['step']}, {last['pss_mb']} MB at step "
                  f"{last['step']} ({last['pss_mb'] / first['pss_mb']:.2f}x); the runtime returned "
                  f"{last['received_mb']} MB", flush=True)
    (HERE / "results" / "coreai_memory.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
