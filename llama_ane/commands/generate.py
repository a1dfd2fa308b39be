"""`llama-ane generate`: stream text from an export, or decode many branches over one shared prefix.

    llama-ane generate OUT --prompt "..."                          one reply, streamed (the export's
                        chat template wraps the prompt when it has one; --raw continues the text itself)
    llama-ane generate default --prompt "..."                      the embedded SmolLM2, unexported (torch)
    llama-ane generate OUT --prompt-file doc.txt --question A --question B   document QA (cascade)
    llama-ane generate OUT --prompt "..." --samples 8 --temperature 0.8      N samples (cascade)
    llama-ane generate OUT --prompt-file doc.txt --question A --prompt-cache doc.npz
                        (the document's K/V saved on the first run, reused by later ones)
    llama-ane generate OUT --prompt-file doc.txt --speculative lookup      speculative decoding:
                        drafts from the prompt verified in one window per step, same output
    cat doc.txt | llama-ane generate OUT --prompt-file - --question "..."   the prompt from stdin
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import click

from ..errors import InvalidArgumentError
from .errors import user_errors
from .options import (BACKEND, TEXT, OptionError, PathOrRepo, Utf8File, read_text_arg, revision_option,
                      sampling_options)

QUESTION_TEMPLATE = "\n\nQuestion: {question}\nAnswer:"
# Where a raw (untemplated) answer to a document question ends unless --stop says otherwise: a
# base model runs on into the next paragraph or question; with the chat template the end-of-turn
# token ends it.
RAW_ANSWER_STOP = "\n\n"
# Branches stream as whole lines tagged with the branch number ("[2] ..."), so that their text stays
# apart in a terminal and in a pipe: a branch's text so far goes out at a newline, once it holds
# STREAM_WIDTH characters, or once it has waited STREAM_SECONDS (broken at a space where it can be).
STREAM_WIDTH = 72
STREAM_SECONDS = 0.5


@click.command("generate")
@click.argument("out", type=PathOrRepo())  # as typed: "./x" stays a path
@click.option("--prompt", type=TEXT, default=None, help="Prompt text.")
@click.option("--prompt-file", type=Utf8File(stdin=True), default=None,
              help="Read the prompt (e.g. a document) from this UTF-8 file; - reads standard input.")
@click.option("--question", "questions", type=TEXT, multiple=True,
              help="A question about the prompt (repeatable): each is a branch over the shared prompt. "
                   "Without the chat template an answer stops at a blank line unless --stop is given.")
@click.option("--samples", type=int, default=None, help="Decode N samples of the prompt as branches.")
@click.option("--raw", is_flag=True, help="Give the prompt as it is, without the model's chat template "
                                          "(which is applied by default when the export records one).")
@click.option("--chat", is_flag=True, hidden=True, help="Wrap the prompt in the chat template (the default).")
@click.option("--system", type=TEXT, default=None, help="A system prompt (with the chat template).")
@revision_option("OUT")
@click.option("--backend", type=BACKEND, default="auto", show_default=True,
              help="auto = coreml on macOS, torch elsewhere.")
@click.option("--precision", type=click.Choice(["fp16", "fp32"]), default=None,
              help="torch/mil compute precision [default: fp32 for torch on CPU, else the export's].")
@sampling_options(max_new_tokens=128)
@click.option("--overflow", type=click.Choice(["stop", "shift"]), default="stop", show_default=True,
              help="At a full context: stop, or shift (keep the first --keep tokens and the most recent ones, "
                   "go on); a prompt longer than the context is shifted too.")
@click.option("--keep", type=click.IntRange(min=0), default=0, show_default=True,
              help="Tokens at the start that --overflow shift keeps.")
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
def command(out, prompt, prompt_file, questions, samples, raw, chat, system, max_new_tokens, revision, backend,
            precision, temperature, top_k, top_p, min_p, repetition_penalty, seed, stop, overflow, keep,
            prompt_cache, speculative, draft_tokens, as_json):
    """Generate text from the export in OUT (a folder or a Hugging Face repo id).

    OUT `default` is the embedded SmolLM2-135M-Instruct, run unexported by the torch backend (as a
    checkpoint folder is): a check of the model before an export, not a fast runtime."""
    started = time.perf_counter()
    _check_options(prompt, prompt_file, questions, samples, raw, chat, system, speculative,
                   draft_tokens, repetition_penalty, overflow, keep)
    text = prompt if prompt is not None else read_text_arg(prompt_file, "--prompt-file")
    sampling = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                    stop=list(stop), min_p=min_p)
    with user_errors():
        if not text.strip():  # before any template wraps it into something that is not empty
            raise InvalidArgumentError(f"the prompt is empty; give some text with "
                                       f"{'--prompt' if prompt is not None else '--prompt-file'}")
        if prompt_cache is not None and not prompt_cache.parent.is_dir():
            raise InvalidArgumentError(f"--prompt-cache {prompt_cache}: the folder {prompt_cache.parent} does not exist")
        from .session import check_wrapping, load_model

        if speculative is not None:
            out, revision = _check_speculative_export(out, revision, draft_tokens)
        loaded = load_model(out, backend, revision=revision, **({} if precision is None else {"precision": precision}))
        model = loaded.model
        try:
            wrap = not raw and model.has_chat_template
            if (chat or system is not None) and not wrap:
                raise InvalidArgumentError(f"{'--chat' if chat else '--system'} needs a chat template, and this "
                                           f"export records none; drop {'--chat' if chat else '--system'}")
            cache = None
            if prompt_cache is not None:
                cache = model.load_cache(prompt_cache) if prompt_cache.exists() else model.make_cache()
                check_wrapping(cache, "chat" if wrap else "raw", prompt_cache)
                cache.wrapping = "chat" if wrap else "raw"
                sampling["cache"] = cache
            if questions or samples is not None:
                if questions and not wrap and not stop:
                    sampling["stop"] = [RAW_ANSWER_STOP]
                _branches(model, text, list(questions), samples, wrap, system, sampling, as_json)
            else:
                if speculative is not None:
                    sampling.update(speculative=speculative, draft_tokens=draft_tokens)
                sampling.update(repetition_penalty=repetition_penalty, overflow=overflow, keep=keep)
                _single(model, loaded, text, wrap, system, sampling, as_json, raw, started)
            if cache is not None:
                model.save_cache(cache, prompt_cache)
        finally:
            model.close()


def _check_options(prompt, prompt_file, questions, samples, raw, chat, system, speculative,
                   draft_tokens, repetition_penalty, overflow, keep) -> None:
    """Refuse options that cannot go together, by flag, before any model loads."""
    if (prompt is None) == (prompt_file is None):
        raise click.UsageError("give exactly one of --prompt and --prompt-file")
    if questions and samples is not None:
        raise click.UsageError("--question and --samples cannot be combined")
    if speculative is not None and (questions or samples is not None):
        raise click.UsageError("--speculative decodes one continuation: drop --question/--samples")
    if draft_tokens is not None and speculative is None:
        raise click.UsageError("--draft-tokens needs --speculative")
    if raw and chat:
        raise click.UsageError("--raw and --chat contradict each other: the chat template is the default, drop --chat")
    if raw and system is not None:
        raise click.UsageError("--system needs the chat template: drop --raw")
    if samples is not None and samples < 1:
        raise OptionError(f"--samples must be at least 1, got {samples}")
    if repetition_penalty != 1.0 and (questions or samples is not None or speculative is not None):
        raise click.UsageError("--repetition-penalty decodes one plain continuation: drop --question/--samples/"
                               "--speculative")
    if (overflow != "stop" or keep) and (questions or samples is not None):
        raise click.UsageError("--overflow and --keep apply to one continuation: drop --question/--samples")
    if keep and overflow != "shift":
        raise click.UsageError("--keep is what --overflow shift keeps: add --overflow shift")
    if speculative is not None and speculative != "lookup" and (
            not speculative.startswith("draft:") or not speculative.removeprefix("draft:")):
        raise OptionError(f"--speculative must be 'lookup' or 'draft:OUT' (OUT a smaller export of the same "
                          f"tokenizer), got {speculative!r}")


def _check_speculative_export(out, revision, draft_tokens):
    """Refuse --speculative on an export without a verify function (or --draft-tokens beyond its
    window) from its manifest alone, before the model loads. Returns OUT located (a repo id's
    folder) and the revision left to apply. A checkpoint (or "default") is checked once loaded."""
    from ..contract.manifest import MANIFEST, read_manifest
    from ..hub import locate
    from ..runtime.speculative import check_speculative

    if str(out) == "default":
        return out, revision
    folder = locate(out, revision)
    if (folder / MANIFEST).is_file():
        check_speculative(read_manifest(folder, check_hashes=False), draft_tokens)
    return folder, None


def _prompt(model, text: str, wrap: bool, system: str | None) -> str | list[int]:
    from ..runtime.chat import prompt_ids

    return prompt_ids(model, text, system) if wrap else text


def _single(model, loaded, text, wrap, system, sampling, as_json, raw, started):
    from .session import generation_stats, stats_lines

    # the template, where it applies, is already in the ids _prompt gives; text is fed as it is
    result = model.generate(_prompt(model, text, wrap, system), raw=True, **sampling,
                            on_token=None if as_json else lambda e: click.echo(e.text, nl=False))
    stats = {"backend": model.backend.name, "chat_template": wrap,
             **generation_stats(result, loaded, "cache" in sampling, started)}
    if result.speculative is not None:
        stats["speculative"] = result.speculative
    if as_json:
        click.echo(json.dumps({"text": result.text, "token_ids": result.token_ids, **stats}))
        return
    click.echo()
    if result.finish_reason == "context":
        click.echo(f"[stopped: the context of {model.manifest['context_length']} tokens is full; "
                   "--overflow shift goes on]", err=True)
    if not result.token_ids and result.finish_reason == "eos":
        click.echo("[the model ended its reply at once (end of sequence): "
                   + ("a base model may need the text to continue: try --raw]" if wrap else
                      "an instruct model answers a question in its chat template: drop --raw]"), err=True)
    for line in stats_lines(stats["backend"], stats):
        click.echo(line, err=True)
    spec = result.speculative
    if spec is not None:
        click.echo(f"[speculative] {spec['verify_steps']} verify steps, {spec['tokens_per_step']} tokens per "
                   f"verify step, acceptance {spec['acceptance_rate']} ({spec['accepted_tokens']}/"
                   f"{spec['drafted_tokens']} drafted), {spec['decode_steps']} plain steps", err=True)


def _branches(model, text, questions, samples, wrap, system, sampling, as_json):
    """Document QA (one branch per question) or N samples, decoded with the cascade."""
    from ..runtime.cascade import split_shared_prefix
    from ..runtime.chat import prompt_ids

    if samples is not None:
        labels = [f"sample {i + 1}" for i in range(samples)]
        prefix = prompt_ids(model, text, system) if wrap else model.encode(text)
        branches = dict(n=samples)
        if sampling["temperature"] == 0 and samples > 1 and not as_json:
            click.echo("[note: at --temperature 0 every sample is the same greedy text]", err=True)
    else:
        labels = [f"Q: {q}" for q in questions]
        if wrap:
            prefix, own = split_shared_prefix([prompt_ids(model, f"{text}\n\nQuestion: {q}", system)
                                               for q in questions])
        else:
            prefix, own = model.encode(text), [QUESTION_TEMPLATE.format(question=q) for q in questions]
        branches = dict(continuations=own)
    stream = None if as_json else BranchStream(labels)
    out = model.generate_branches(prefix, **branches, **sampling,
                                  on_token=None if stream is None else stream.on_token)
    s = out.stats
    summary = {"backend": model.backend.name, "chat_template": wrap, "prefix_tokens": s.prefix_tokens,
               "num_branches": s.branches,
               "steps": s.steps, "generated_tokens": s.generated_tokens,
               "prefill_seconds": round(s.prefill_seconds, 3), "decode_seconds": round(s.decode_seconds, 3),
               "aggregate_decode_tokens_per_s": round(s.decode_tokens_per_s, 2),
               # a model (cache shapes x prefix tokens), not a measurement: see runtime.cascade.prefix_bytes_per_step
               "modelled_prefix_bytes_per_step_cascade": s.prefix_bytes_per_step_cascade,
               "modelled_prefix_bytes_per_step_separate": s.prefix_bytes_per_step_separate}
    if "cache" in sampling:
        summary["reused_tokens"] = s.reused_tokens
    if as_json:
        click.echo(json.dumps({"branches": [{"label": label, "text": r.text, "token_ids": r.token_ids,
                                             "finish_reason": r.finish_reason}
                                            for label, r in zip(labels, out.branches)], **summary}))
        return
    stream.finish(out.branches)
    reused = f" ({s.reused_tokens} reused from the cache)" if "cache" in sampling else ""
    click.echo(f"[{summary['backend']}] prefix: {s.prefix_tokens} tokens{reused}, "
               f"prefilled in {summary['prefill_seconds']} s", err=True)
    click.echo(f"[{summary['backend']}] {s.branches} branches over a {s.prefix_tokens}-token prefix: "
               f"{s.generated_tokens} tokens in {s.steps} steps, {summary['aggregate_decode_tokens_per_s']} tok/s "
               f"aggregate | prefix K/V read per step, modelled from the cache shapes: "
               f"{s.prefix_bytes_per_step_cascade / 1e6:.2f} MB cascade vs {s.prefix_bytes_per_step_separate / 1e6:.2f} MB "
               "separately", err=True)


class BranchStream:
    """Print cascade branches as they decode: a header per branch ("--- [1] Q: ..."), then each
    branch's text in lines tagged with its number ("[1] ..."), interleaved as the branches go."""

    def __init__(self, labels: list[str]):
        self.pending = [""] * len(labels)
        self.since = [0.0] * len(labels)  # when each branch's pending text began to wait
        for i, label in enumerate(labels):
            click.echo(f"--- [{i + 1}] {label}")

    def on_token(self, index: int, token_id: int, delta: str) -> None:
        if not delta:
            return
        now = time.perf_counter()
        if not self.pending[index]:
            self.since[index] = now
        self.pending[index] += delta
        for i, text in enumerate(self.pending):
            if text and ("\n" in text or len(text) >= STREAM_WIDTH or now - self.since[i] >= STREAM_SECONDS):
                self._flush(i, now)

    def _flush(self, i: int, now: float) -> None:
        """Print branch i's complete lines, then the rest up to its last space (all of it where it has none)."""
        text = self.pending[i]
        cut = text.rfind("\n") + 1
        if cut == 0:
            space = max(text.rfind(" ", 1), text.rfind("\t", 1))
            cut = space if space > 0 else len(text)
        self._lines(i, text[:cut])
        self.pending[i], self.since[i] = text[cut:], now

    def _lines(self, i: int, text: str) -> None:
        for line in text.split("\n"):
            if line.strip():
                click.echo(f"[{i + 1}] {line.strip()}")

    def finish(self, results) -> None:
        """Print what each branch still holds, and why a branch stopped where it did not end by itself."""
        for r in results:
            self._lines(r.index, self.pending[r.index])
            self.pending[r.index] = ""
            if r.finish_reason not in ("eos", "stop"):
                click.echo(f"[{r.index + 1}] [finish: {r.finish_reason}]")
