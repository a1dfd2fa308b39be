"""Speculative decoding (prompt lookup, token trees verified in one window) vs plain decoding.

On SmolLM2-135M-Instruct (the embedded default), greedy, with the chat template: document-grounded
tasks where the answer reuses the prompt's text (quote, summarise, rewrite a document, edit code)
and free chat where it does not. For each task both ways run in the same process on the same
prompt cache (the prompt is prefilled once, so only decoding is compared) and must give the same
tokens (checked). Reported per task:

  * tokens per verify step and the acceptance rate (measured);
  * wall-clock decode speedup on the torch backend, CPU: plain decode seconds / speculative
    decode seconds (measured, same process; each way runs `--repeats` times, alternated, and the
    median run of each is compared; every run's seconds are in the json);
  * the analytic device speedup, a MODEL, not a measurement: decode on the Neural Engine is bound
    by the bytes each step moves, so a step is timed as its bytes (`contract.traffic`: weights,
    caches, and the window's own tensors, for an fp16 export with a 16-token verify window), and
    the speedup is plain decoding's bytes for the same tokens over the speculative run's bytes
    (its verify steps and its plain steps, as the CPU run took them);
  * the lookup oracle, COMPUTED, not measured: the speedup of a drafter that knows the output and
    drafts from the text alone. At every step it drafts exactly the longest continuation that
    follows an earlier occurrence of the last token in the prompt or the generated text (a chain
    accepted whole; a plain step where no occurrence continues right), each window costed at the
    verify costs measured below. Prompt lookup drafts from those same occurrences, so no step of
    it accepts more from the same point: the oracle estimates the most lookup can give on this
    machine, and so how much of a task's gap is in the drafting and how much in what a window costs.

Before the tasks it measures what a verify window of n nodes costs against a plain decode step on
the first task's prompt (a chain of n tokens; best of `--repeats` x 3 alternated runs each): the
"step_costs" of the json, which the lookup oracle uses.

Results go to benchmarks/results/NAME.{json,png} (`--name`, default "speculative").

    python benchmarks/speculative.py [--model default|FOLDER] [--new-tokens 96] [--threads 1] [--repeats 3]
                                         [--tasks quote,rewrite] [--name speculative]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import numpy as np
import torch

import llama_ane
from llama_ane.contract.plan import describe_checkpoint
from llama_ane.contract.traffic import decode_step_traffic, window_io_bytes
from llama_ane.runtime.drafters import DraftTree

RESULTS = Path(__file__).parent / "results"
DOCUMENT = (Path(__file__).parent / "document.txt").read_text().strip()
CODE = '''def load_rows(path):
    rows = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            rows.append(line.split(","))
    return rows


def total(rows, column):
    result = 0
    for row in rows:
        result += float(row[column])
    return result
'''

TASKS = [  # (name, kind, user message)
    ("quote", "document", f"{DOCUMENT}\n\nCopy the first two paragraphs of the text above exactly, word for word."),
    ("summarise", "document", f"{DOCUMENT}\n\nSummarise the text above in a few sentences."),
    ("rewrite", "document", f"{DOCUMENT}\n\nRewrite the first paragraph of the text above in simpler words."),
    ("edit code", "document", f"{CODE}\nRename the function `load_rows` to `read_rows` everywhere and print the "
                              "whole code again."),
    ("chat: poem", "chat", "Write a short poem about autumn in a small town."),
    ("chat: advice", "chat", "Give me three tips for learning to cook at home."),
]


def device_bytes(steps: dict, tokens: int, manifest: dict) -> tuple[int, int]:
    """(bytes of plain decoding of `tokens`, bytes of the speculative run) under the traffic model."""
    base = decode_step_traffic(manifest).total
    decode, verify = base + window_io_bytes(manifest, "decode"), base + window_io_bytes(manifest, "verify")
    return tokens * decode, steps["verify_steps"] * verify + steps["decode_steps"] * decode


def step_costs(model, prompt: list[int], sizes: list[int], repeats: int) -> dict[int, float]:
    """{n: seconds of a verify window of a chain of n nodes / seconds of a plain decode step}, on
    a cache holding `prompt` (best of `repeats` alternated runs of each; nothing is kept)."""
    pipeline = model.pipeline
    pipeline.reset()
    pipeline.prefill(prompt)
    start, root = pipeline.position, int(prompt[-1])

    def plain():
        pipeline.run_window([root])
        pipeline.rewind(start)

    def window(n):
        tree = DraftTree.root(root)
        node = 0
        for i in range(n - 1):
            node = tree.add(node, (root + 1 + i) % model.manifest["config"]["vocab_size"])
        pipeline.verify_tree(np.asarray(tree.tokens, np.int32), tree.depths(), tree.mask(pipeline.backend.dtype))
        pipeline.accept([0])
        pipeline.rewind(start)

    best = {n: float("inf") for n in [1, *sizes]}
    for _ in range(repeats):
        for n in best:
            t0 = time.perf_counter()
            plain() if n == 1 else window(n)
            best[n] = min(best[n], time.perf_counter() - t0)
    pipeline.reset()
    return {n: best[n] / best[1] for n in best}


def lookup_oracle(prompt: list[int], generated: list[int], cost) -> dict:
    """The lookup oracle of the module docstring for `generated` after `prompt`: the speedup over
    plain steps (each costing 1) when every step drafts the longest continuation of the text that
    an earlier occurrence of its last token offers, a window of n nodes costing cost(n).

    Also counted: the windows (and the tokens they accept) whose continuation follows only a
    one-token match, an occurrence of the last token whose previous token differs: those a
    drafter has to pick among all the occurrences of that token."""
    text, steps, total, windows, single, single_tokens = list(prompt) + list(generated[:1]), 0, 0.0, 0, 0, 0
    i = 1
    while i < len(generated):
        longest, context = 0, 0
        for s in np.flatnonzero(np.asarray(text[:-1]) == text[-1]).tolist():
            run = 0
            while s + 1 + run < len(text) and i + run < len(generated) and text[s + 1 + run] == generated[i + run]:
                run += 1
            matched = 1 + int(s >= 1 and text[s - 1] == text[-2])
            if (run, matched) > (longest, context):
                longest, context = run, matched
        total += cost(longest + 1) if longest else 1.0
        windows += bool(longest)
        single += bool(longest) and context == 1
        single_tokens += longest if context == 1 else 0
        steps += 1
        text += generated[i:i + longest + 1]
        i += longest + 1
    return {"speedup": round((len(generated) - 1) / total, 3) if total else float("nan"),
            "windows": windows, "plain_steps": steps - windows,
            "one_token_match_windows": single, "one_token_match_tokens": single_tokens}


def median_run(runs: list):
    """The run of median decode seconds (the upper one of an even count)."""
    return sorted(runs, key=lambda r: r.decode_seconds)[len(runs) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default", help="export folder, checkpoint folder, .gguf or 'default'")
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--tasks", default=None, help="comma-separated task names (default: all)")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each way per task (the median is reported)")
    ap.add_argument("--name", default="speculative", help="results file name under benchmarks/results/")
    ap.add_argument("--verify-window", type=int, default=16,
                    help="W of the verify function when --model is a checkpoint (an export has its own)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    src = None if args.model == "default" else Path(args.model)
    exported = src is not None and (src / "manifest.json").exists()
    model = llama_ane.load(args.model, backend="torch", precision="fp32",
                           **({} if exported else {"verify_window": args.verify_window}))
    model.prepare()
    device_manifest = (model.manifest if exported  # else an fp16 export of it
                       else describe_checkpoint(src, precision="fp16", verify_window=args.verify_window)[0])
    tasks = [t for t in TASKS if args.tasks is None or t[0] in args.tasks.split(",")]
    # one speculative generation first, not timed: the first call of each function runs slower
    model.generate(model.encode(TASKS[0][2][:400], chat=True), max_new_tokens=8, speculative="lookup")
    load_before = os.getloadavg()
    sizes = [2, 3, 4, 6, 8, 12, model.manifest["verify_window"]]
    costs = step_costs(model, model.encode(tasks[0][2], chat=True), sizes, 3 * args.repeats)
    print("verify window cost in plain steps (measured): "
          + ", ".join(f"{n} nodes {c:.2f}" for n, c in costs.items() if n > 1), flush=True)

    def cost(n: int) -> float:
        return float(np.interp(n, list(costs), list(costs.values())))

    rows = []
    for name, kind, message in tasks:
        prompt = model.encode(message, chat=True)
        cache = model.make_cache()
        model.generate(prompt, max_new_tokens=1, cache=cache)  # prefill once; both runs reuse it
        plains, specs = [], []
        for _ in range(args.repeats):  # alternated, so that a change in the machine's load hits both
            plains.append(model.generate(prompt, max_new_tokens=args.new_tokens, cache=cache))
            specs.append(model.generate(prompt, max_new_tokens=args.new_tokens, cache=cache, speculative="lookup"))
            if specs[-1].token_ids != plains[0].token_ids or plains[-1].token_ids != plains[0].token_ids:
                raise SystemExit(f"{name}: speculative decoding changed the greedy output")
        plain, spec = median_run(plains), median_run(specs)
        tokens = spec.decoded_tokens
        plain_bytes, spec_bytes = device_bytes(spec.speculative, tokens, device_manifest)
        oracle = lookup_oracle(prompt, plain.token_ids, cost)
        row = {"task": name, "kind": kind, "prompt_tokens": len(prompt), "generated_tokens": len(plain.token_ids),
               "plain_decode_s": round(plain.decode_seconds, 3), "speculative_decode_s": round(spec.decode_seconds, 3),
               "plain_runs_s": [round(r.decode_seconds, 3) for r in plains],
               "speculative_runs_s": [round(r.decode_seconds, 3) for r in specs],
               "wall_clock_speedup": round(plain.decode_seconds / spec.decode_seconds, 3),
               **spec.speculative,
               "device_model_speedup": round(plain_bytes / spec_bytes, 3),
               "lookup_oracle": oracle,
               "text": plain.text[:200]}
        rows.append(row)
        print(f"{name:13s} {row['generated_tokens']:4d} tokens | {row['tokens_per_step']:.2f} tokens/verify step, "
              f"acceptance {row['acceptance_rate']:.2f}, {row['verify_steps']} verify + {row['decode_steps']} plain "
              f"steps | wall-clock {row['wall_clock_speedup']:.2f}x (torch CPU) | device model "
              f"{row['device_model_speedup']:.2f}x | lookup oracle {oracle['speedup']:.2f}x", flush=True)
    RESULTS.mkdir(exist_ok=True)
    out = {"model": model.manifest["name"], "backend": "torch", "precision": "fp32", "threads": args.threads,
           "repeats": args.repeats,
           "machine": f"{platform.machine()} {platform.processor()}".strip(), "new_tokens": args.new_tokens,
           "drafter": "lookup", "verify_window": model.manifest["verify_window"],
           "device_model": "bytes per step of an fp16 export (contract.traffic): a model, not a measurement",
           "step_costs": {str(n): round(c, 3) for n, c in costs.items()},
           "lookup_oracle": "computed from the text and the measured step_costs (see the docstring), not measured",
           "load_average": {"before": [round(x, 2) for x in load_before],
                            "after": [round(x, 2) for x in os.getloadavg()], "cpus": os.cpu_count()},
           "rows": rows}
    (RESULTS / f"{args.name}.json").write_text(json.dumps(out, indent=2) + "\n")
    plot(rows, RESULTS / f"{args.name}.png")
    print(f"load average (1, 5, 15 min) before {out['load_average']['before']}, after {out['load_average']['after']}")
    print(f"wrote {RESULTS / args.name}.json and .png")


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["task"] for r in rows]
    x = range(len(rows))
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    a.bar(x, [r["tokens_per_step"] for r in rows], color=["tab:blue" if r["kind"] == "document" else "tab:gray"
                                                          for r in rows])
    a.axhline(2.0, color="k", lw=0.8, ls="--")
    a.set_xticks(list(x), names, rotation=30, ha="right")
    a.set_ylabel("tokens per verify step")
    a.set_title("prompt lookup: tokens per verify step")
    w = 0.38
    b.bar([i - w / 2 for i in x], [r["wall_clock_speedup"] for r in rows], w, label="wall clock, torch CPU (measured)")
    b.bar([i + w / 2 for i in x], [r["device_model_speedup"] for r in rows], w,
          label="device, bytes per step (model)", hatch="//", alpha=0.7)
    b.scatter([i - w / 2 for i in x], [r["lookup_oracle"]["speedup"] for r in rows], marker="_", s=300, color="k",
              zorder=3, label="lookup oracle, CPU (computed)")
    b.axhline(1.0, color="k", lw=0.8)
    b.set_xticks(list(x), names, rotation=30, ha="right")
    b.set_ylabel("speedup over plain decoding")
    b.legend(fontsize=8)
    b.set_title("speculative vs plain decoding (same tokens)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
