"""`llama-ane generate`: stream text from an export, or decode many branches over one shared prefix.

    llama-ane generate OUT --prompt "..."                          one continuation, streamed
    llama-ane generate OUT --prompt-file doc.txt --question A --question B   document QA (cascade)
    llama-ane generate OUT --prompt "..." --samples 8 --temperature 0.8      N samples (cascade)
    llama-ane generate OUT --prompt-file doc.txt --question A --prompt-cache doc.npz
                        (the document's K/V saved on the first run, reused by later ones)
    llama-ane generate OUT --prompt-file doc.txt --speculative lookup      speculative decoding:
                        drafts from the prompt verified in one window per step, same output
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from ..errors import InvalidArgumentError
from ..runtime.model import BACKENDS
from .errors import user_errors
from .options import TEMPERATURE, TEXT, TOP_P, Utf8File

QUESTION_TEMPLATE = "\n\nQuestion: {question}\nAnswer:"


@click.command("generate")
@click.argument("out", type=click.Path(path_type=str))  # as typed: "./x" stays a path
@click.option("--prompt", type=TEXT, default=None, help="Prompt text.")
@click.option("--prompt-file", type=Utf8File(), default=None,
              help="Read the prompt (e.g. a document) from this UTF-8 file.")
@click.option("--question", "questions", type=TEXT, multiple=True,
              help="A question about the prompt (repeatable): each is a branch over the shared prompt.")
@click.option("--samples", type=int, default=None, help="Decode N samples of the prompt as branches.")
@click.option("--chat", is_flag=True, help="Wrap the prompt in the model's chat template.")
@click.option("--max-new-tokens", default=128, show_default=True)
@click.option("--revision", default=None, help="Branch, tag or commit of OUT when it is a Hugging Face repo id.")
@click.option("--backend", type=click.Choice(BACKENDS), default="auto", show_default=True,
              help="auto = coreml on macOS, torch elsewhere.")
@click.option("--precision", type=click.Choice(["fp16", "fp32"]), default=None,
              help="torch/mil compute precision [default: fp32 for torch on CPU, else the export's].")
@click.option("--temperature", type=TEMPERATURE, default=0.0, show_default=True, help="0 = greedy.")
@click.option("--top-k", default=0, show_default=True, help="0 = off.")
@click.option("--top-p", type=TOP_P, default=1.0, show_default=True)
@click.option("--seed", type=int, default=None)
@click.option("--stop", type=TEXT, multiple=True, help="Stop at this string (repeatable).")
@click.option("--prompt-cache", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="A prompt-cache file: reused if it exists (only the prompt's new tokens are prefilled), "
                   "created or updated otherwise.")
@click.option("--speculative", default=None, metavar="lookup|draft:OUT",
              help="Speculative decoding: 'lookup' drafts from n-gram matches in the prompt and the text so far, "
                   "'draft:OUT' with a smaller export of the same tokenizer; the output is the same as without. "
                   "Needs an export made with --verify-window W.")
@click.option("--draft-tokens", type=int, default=None,
              help="Most drafted tokens per verify step [default: the export's verify window - 1].")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of streaming.")
def command(out, prompt, prompt_file, questions, samples, chat, max_new_tokens, revision, backend, precision, temperature,
            top_k, top_p, seed, stop, prompt_cache, speculative, draft_tokens, as_json):
    """Generate text from the export in OUT (a folder or a Hugging Face repo id)."""
    import llama_ane

    if (prompt is None) == (prompt_file is None):
        raise click.UsageError("give exactly one of --prompt and --prompt-file")
    if questions and samples is not None:
        raise click.UsageError("--question and --samples cannot be combined")
    if speculative is not None and (questions or samples is not None):
        raise click.UsageError("--speculative decodes one continuation: drop --question/--samples")
    if draft_tokens is not None and speculative is None:
        raise click.UsageError("--draft-tokens needs --speculative")
    text = prompt if prompt is not None else prompt_file.read_text(encoding="utf-8")
    sampling = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                    stop=list(stop))
    with user_errors():
        if samples is not None and samples < 1:
            raise InvalidArgumentError(f"--samples must be at least 1, got {samples}")
        if prompt_cache is not None and not prompt_cache.parent.is_dir():
            raise InvalidArgumentError(f"--prompt-cache {prompt_cache}: the folder {prompt_cache.parent} does not exist")
        model = llama_ane.load(out, backend=backend, revision=revision,
                               **({} if precision is None else {"precision": precision}))
        try:
            model.prepare()  # load every model before the clock starts
            cache = None
            if prompt_cache is not None:
                cache = model.load_cache(prompt_cache) if prompt_cache.exists() else model.make_cache()
                sampling["cache"] = cache
            if questions or samples is not None:
                _branches(model, text, list(questions), samples, chat, sampling, as_json)
            else:
                if speculative is not None:
                    sampling.update(speculative=speculative, draft_tokens=draft_tokens)
                _single(model, text, chat, sampling, as_json)
            if cache is not None:
                model.save_cache(cache, prompt_cache)
        finally:
            model.close()


def _single(model, text, chat, sampling, as_json):
    result = model.generate(model.encode(text, chat=True) if chat else text, **sampling,
                            on_token=None if as_json else lambda e: click.echo(e.text, nl=False))
    stats = {"backend": model.backend.name, "prompt_tokens": result.prompt_tokens,
             "reused_tokens": result.reused_tokens, "prefill_seconds": round(result.prefill_seconds, 3),
             "generated_tokens": len(result.token_ids), "finish_reason": result.finish_reason,
             "prefill_tokens_per_s": round(result.prefill_tokens_per_s, 2),
             "decode_tokens_per_s": round(result.decode_tokens_per_s, 2)}
    if result.speculative is not None:
        stats["speculative"] = result.speculative
    if as_json:
        click.echo(json.dumps({"text": result.text, "token_ids": result.token_ids, **stats}))
        return
    click.echo()
    if result.finish_reason == "context":
        click.echo(f"[stopped: the context of {model.manifest['context_length']} tokens is full]", err=True)
    reused = f" ({result.reused_tokens} reused from the cache)" if result.reused_tokens else ""
    click.echo(f"[{stats['backend']}] prefill: {result.prefilled_tokens} tokens{reused} in "
               f"{stats['prefill_seconds']} s, {stats['prefill_tokens_per_s']} tok/s | "
               f"decode: {result.decoded_tokens} tokens, {stats['decode_tokens_per_s']} tok/s | "
               f"finish: {result.finish_reason}", err=True)
    spec = result.speculative
    if spec is not None:
        click.echo(f"[speculative] {spec['verify_steps']} verify steps, {spec['tokens_per_step']} tokens per "
                   f"verify step, acceptance {spec['acceptance_rate']} ({spec['accepted_tokens']}/"
                   f"{spec['drafted_tokens']} drafted), {spec['decode_steps']} plain steps", err=True)


def _branches(model, text, questions, samples, chat, sampling, as_json):
    """Document QA (one branch per question) or N samples, decoded with the cascade."""
    from ..runtime.cascade import split_shared_prefix

    if samples is not None:
        labels = [f"sample {i + 1}" for i in range(samples)]
        out = model.generate_branches(model.encode(text, chat=chat), n=samples,
                                      **sampling)
        if sampling["temperature"] == 0 and samples > 1 and not as_json:
            click.echo("[note: at --temperature 0 every sample is the same greedy text]", err=True)
    else:
        labels = [f"Q: {q}" for q in questions]
        if chat:
            prefix, own = split_shared_prefix([model.encode(f"{text}\n\nQuestion: {q}", chat=True) for q in questions])
        else:
            prefix, own = model.encode(text), [QUESTION_TEMPLATE.format(question=q) for q in questions]
        out = model.generate_branches(prefix, own, **sampling)
    s = out.stats
    summary = {"backend": model.backend.name, "prefix_tokens": s.prefix_tokens, "reused_tokens": s.reused_tokens,
               "num_branches": s.branches,
               "steps": s.steps, "generated_tokens": s.generated_tokens,
               "prefill_seconds": round(s.prefill_seconds, 3), "decode_seconds": round(s.decode_seconds, 3),
               "aggregate_decode_tokens_per_s": round(s.decode_tokens_per_s, 2),
               # a model (cache shapes x prefix tokens), not a measurement: see runtime.cascade.prefix_bytes_per_step
               "modelled_prefix_bytes_per_step_cascade": s.prefix_bytes_per_step_cascade,
               "modelled_prefix_bytes_per_step_separate": s.prefix_bytes_per_step_separate}
    if as_json:
        click.echo(json.dumps({"branches": [{"label": label, "text": r.text, "token_ids": r.token_ids,
                                             "finish_reason": r.finish_reason}
                                            for label, r in zip(labels, out.branches)], **summary}))
        return
    for label, r in zip(labels, out.branches):
        click.echo(f"--- [{r.index + 1}] {label}")
        click.echo(r.text.strip())
    click.echo(f"[{summary['backend']}] prefix: {s.prefix_tokens} tokens ({s.reused_tokens} reused from the cache), "
               f"prefilled in {summary['prefill_seconds']} s", err=True)
    click.echo(f"[{summary['backend']}] {s.branches} branches over a {s.prefix_tokens}-token prefix: "
               f"{s.generated_tokens} tokens in {s.steps} steps, {summary['aggregate_decode_tokens_per_s']} tok/s "
               f"aggregate | prefix K/V read per step, modelled from the cache shapes: "
               f"{s.prefix_bytes_per_step_cascade / 1e6:.2f} MB cascade vs {s.prefix_bytes_per_step_separate / 1e6:.2f} MB "
               "separately", err=True)
