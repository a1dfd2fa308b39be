"""Memory of a process decoding with the coreai backend: PSS every 200 steps of a 2000-step greedy
decode of a tiny random Llama exported with --target coreai (fp32), once with each cache kind,
beside the bytes the runtime returned (which it keeps: docs/coreai.md). A third process calls one
function of the state export through coreai.runtime alone, with the same input arrays every call,
and prints what each call adds, so the growth can be told apart from anything llama-ane does.

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

# One function (the embeddings' decode at the first bucket) through the runtime's own API.
RUNTIME_ALONE = """
import asyncio, gc, json, sys
import numpy as np, psutil
from coreai.authoring.asset import AIModelAsset
from coreai.runtime import NDArray
proc = psutil.Process()
def pss():
    gc.collect()
    return proc.memory_full_info().pss
async def main(path, function, calls):
    async with AIModelAsset.load(path).executable() as model:
        f = model.load_function(function)
        feed = {"input_ids": NDArray(np.array([[5]], np.int32)), "position": NDArray(np.array([100], np.int32))}
        for _ in range(50):
            await f(feed)
        before, out_bytes = pss(), 0
        for _ in range(calls):
            out = await f(feed)
            out_bytes += sum(v.numpy().nbytes for v in out.values())
            del out
        print(json.dumps({"calls": calls, "pss_growth_bytes_per_call": round((pss() - before) / calls),
                          "output_bytes_per_call": out_bytes // calls}))
asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
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
        manifest = json.loads((Path(tmp) / "state" / "manifest.json").read_text())
        emb = manifest["models"]["embeddings"]
        function = next(f for f in emb["functions"] if f.startswith("decode"))
        entry = emb["functions"][function]
        run = subprocess.run([sys.executable, "-c", RUNTIME_ALONE, str(Path(tmp) / "state" / entry["file"]),
                              entry.get("function_name") or function,
                              str(args.steps * 2)], capture_output=True, text=True, check=True)
        alone = json.loads(run.stdout.strip().splitlines()[-1])
        result["runtime_alone"] = {"function": f"embeddings/{function}", **alone}
        print(f"coreai.runtime alone, {alone['calls']} calls of embeddings/{function}: PSS grew "
              f"{alone['pss_growth_bytes_per_call']} B a call, which returns {alone['output_bytes_per_call']} B",
              flush=True)
    (HERE / "results" / "coreai_memory.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
