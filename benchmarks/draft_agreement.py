"""How often drafters that need no second model guess SmolLM2's next greedy token.

Speculative decoding gains where a drafter guesses the model's next tokens for much less than a step
costs. Prompt lookup guesses from the text. Where an answer is new wording (summarise, rewrite) a
drafter has to predict it, which takes a model, and no draft model smaller than SmolLM2-135M shares
its tokenizer. This replays the greedy answers of speculative.py's tasks and counts, over every
step (its root token, the last one produced, and the model's next token after it), how often each
of these drafters guesses that next token:

  * `lookup`: the token that followed the most recent earlier occurrence of the root in the prompt
    or the answer so far (prompt lookup's proposal after a one-token match);
  * `recycled@K`: one of the model's own K best tokens after the root's most recent earlier
    occurrence in the answer, as decoding computed them (token recycling: the logits of earlier
    steps reused; none before the root's first repeat);
  * `exit@L`: the token the final norm and LM head choose after the first L decoder layers
    (self-drafting by skipping the later layers, without training for it), each with the share
    of a step's projection weights such a draft reads (counted from the shapes, not timed). At the
    last layer this is the model itself: transformers' arithmetic against the torch backend's
    greedy tokens, which checks that the replay is aligned.

Prints a table and writes benchmarks/results/NAME.json (`--name`, default "draft_agreement").

    python benchmarks/draft_agreement.py [--model default|FOLDER] [--new-tokens 96] [--tasks summarise,rewrite]
                                         [--layers 8,16,24]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # speculative.py, beside this script, has the tasks
from speculative import RESULTS, TASKS  # noqa: E402

import llama_ane  # noqa: E402
from llama_ane.checkpoint.loader import load_checkpoint  # noqa: E402
from llama_ane.chunks.plan import layer_shapes  # noqa: E402
from llama_ane.reference import final_outputs, run_layers  # noqa: E402

TOP = 4  # the model's best tokens kept per decode step, for recycled@1..TOP


def greedy_answer(model, prompt: Sequence[int], new_tokens: int) -> tuple[list[int], np.ndarray]:
    """Plain greedy decoding after `prompt`: the tokens (new_tokens) and, after each of them, the
    model's TOP best next tokens int64 [new_tokens, TOP], best first."""
    pipeline = model.pipeline
    pipeline.reset()
    logits = pipeline.prefill(list(prompt))
    tokens, tops = [], []
    for _ in range(new_tokens):
        tokens.append(int(np.argmax(logits)))
        logits = pipeline.run_window([tokens[-1]])[0]
        tops.append(np.argsort(-logits, kind="stable")[:TOP])
    pipeline.reset()
    return tokens, np.asarray(tops)


def lookup_hits(prompt: Sequence[int], answer: Sequence[int]) -> float:
    """The share of steps i >= 1 (root answer[i-1]) where the token after the root's most recent
    earlier occurrence in prompt + answer[:i-1] is answer[i] (no occurrence: a miss)."""
    text, hits = list(prompt), 0
    for i in range(1, len(answer)):
        root = answer[i - 1]
        at = [s for s, t in enumerate(text) if t == root and s + 1 < len(text)]
        hits += bool(at) and text[at[-1] + 1] == answer[i]
        text.append(root)
    return hits / (len(answer) - 1)


def recycled_hits(answer: Sequence[int], tops: np.ndarray, k: int) -> float:
    """The share of steps i >= 1 (root answer[i-1]) where answer[i] is among the model's k best
    tokens after the root's most recent earlier occurrence in the answer (tops[j]: after answer[j])."""
    last: dict[int, int] = {}  # token -> the latest step j < i - 1 that produced it
    hits = 0
    for i in range(1, len(answer)):
        root = answer[i - 1]
        hits += root in last and answer[i] in tops[last[root], :k].tolist()
        last[root] = i - 1
    return hits / (len(answer) - 1)


def early_exit_tokens(ckpt, prompt: Sequence[int], answer: Sequence[int], layers: Sequence[int]) -> dict[int, np.ndarray]:
    """{L: the tokens int64 [len(answer)] chosen after the first L layers}: for each answer token,
    the final norm and LM head applied to the hidden state before it, in transformers' float32."""
    ids = list(prompt) + list(answer[:-1])
    first = len(prompt) - 1  # the position whose next token is answer[0]
    hidden: dict[int, torch.Tensor] = {}

    def on_layer(n: int, layer):
        if n + 1 not in layers:
            return None
        hook = layer.register_forward_hook(
            lambda _m, _i, out: hidden.__setitem__(n + 1, (out[0] if isinstance(out, tuple) else out)[0, first:].clone()))
        return hook.remove

    run_layers(ckpt, ids, logits=False, on_layer=on_layer)
    return {n: final_outputs(ckpt, h).argmax(-1) for n, h in hidden.items()}


def exit_weight_share(cfg, layers: int) -> float:
    """The projection weights an early exit after `layers` layers reads (those layers and the LM
    head) over a full step's (all layers and the head)."""
    per_layer = sum(int(np.prod(s)) for s in layer_shapes(cfg).values() if len(s) == 2)
    head = cfg.vocab_size * cfg.hidden_size
    return (layers * per_layer + head) / (cfg.num_hidden_layers * per_layer + head)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default", help="checkpoint folder, .gguf or 'default' (not an export)")
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--tasks", default=None, help="comma-separated task names of speculative.py (default: all)")
    ap.add_argument("--layers", default=None,
                    help="early exits, after this many layers (default: about 1/4, 1/2, 2/3, 4/5 and 14/15 of them)")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    ap.add_argument("--name", default="draft_agreement", help="results file name under benchmarks/results/")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    ckpt = load_checkpoint(None if args.model == "default" else args.model)
    cfg = ckpt.config
    total = cfg.num_hidden_layers
    try:
        exits = ([int(n) for n in args.layers.split(",")] if args.layers
                 else [max(1, round(f * total)) for f in (1 / 4, 1 / 2, 2 / 3, 4 / 5, 14 / 15)])
    except ValueError:
        exits = [0]  # refused just below
    layers = sorted(set(exits) | {total})
    if layers[0] < 1 or layers[-1] > total:
        raise SystemExit(f"--layers must be 1..{total} (the model has {total}), got {args.layers}")
    names = [t[0] for t in TASKS]
    chosen = names if args.tasks is None else args.tasks.split(",")
    unknown = [t for t in chosen if t not in names]
    if unknown:
        raise SystemExit(f"unknown task(s) {unknown}; speculative.py has {names}")
    model = llama_ane.load(args.model, backend="torch", precision="fp32")
    rows = []
    head = f"{'task':13s} {'lookup':>7s} " + " ".join(f"{'recycled@' + str(k):>11s}" for k in (1, TOP)) + " " + \
           " ".join(f"{'exit@' + str(n):>8s}" for n in layers)
    print(head)
    for name, kind, message in TASKS:
        if name not in chosen:
            continue
        prompt = model.encode(message, chat=True)
        answer, tops = greedy_answer(model, prompt, args.new_tokens)
        exits = early_exit_tokens(ckpt, prompt, answer, layers)
        row = {"task": name, "kind": kind, "prompt_tokens": len(prompt), "steps": len(answer) - 1,
               "lookup": round(lookup_hits(prompt, answer), 3),
               "recycled": {str(k): round(recycled_hits(answer, tops, k), 3) for k in (1, TOP)},
               "early_exit": {str(n): round(float((exits[n] == np.asarray(answer)).mean()), 3) for n in layers}}
        rows.append(row)
        print(f"{name:13s} {row['lookup']:7.2f} " + " ".join(f"{row['recycled'][str(k)]:11.2f}" for k in (1, TOP))
              + " " + " ".join(f"{row['early_exit'][str(n)]:8.2f}" for n in layers), flush=True)
    shares = {str(n): round(exit_weight_share(cfg, n), 3) for n in layers}
    print("weights an early exit reads, of a step's (from the shapes): "
          + ", ".join(f"exit@{n} {s}" for n, s in shares.items()))
    RESULTS.mkdir(exist_ok=True)
    out = {"model": model.manifest["name"], "new_tokens": args.new_tokens, "layers": total,
           "measured": "the share of steps whose next greedy token each drafter guesses (see the docstring)",
           "early_exit_weight_share": shares, "rows": rows}
    (RESULTS / f"{args.name}.json").write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {RESULTS / args.name}.json")
    model.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
