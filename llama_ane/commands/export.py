"""`llama-ane export`: a checkpoint to an export folder of .mlpackage files and manifest.json."""

from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path
from typing import Iterator

import click

from ..quantize.auto import DEFAULT_BUDGET_PCT
from ..quantize.schemes import DEFAULT_GROUP_SIZE, SCHEMES
from ..errors import InvalidArgumentError
from ..hub import resolve
from .errors import user_errors
from .options import FiniteFloat, LazyChoice


@click.command("export")
@click.argument("model", required=False)
@click.option("-o", "--out", "out", required=True, type=click.Path(path_type=Path), help="Export folder to create.")
@click.option("--revision", default=None, help="Branch, tag or commit of MODEL when it is a Hugging Face repo id.")
@click.option("--context-length", default=1024, show_default=True, help="Tokens the KV cache holds.")
@click.option("--prefill-length", default=64, show_default=True, help="Query length of the prefill functions.")
@click.option("--layers-per-chunk", type=int, default=None,
              help="Decoder layers per block-chunk file [default: from weight bytes, <= ~1 GB (iOS) / 2 GB (macOS)].")
@click.option("--branches", "branch_width", default=8, show_default=True,
              help="Cascade width B: branches decoded per step over a shared prefix (0 = none).")
@click.option("--suffix-length", default=256, show_default=True,
              help="Tokens each cascade branch may add after the shared prefix.")
@click.option("--verify-window", type=int, default=0, show_default=True,
              help="Tokens of the token tree one speculative-decoding step verifies, e.g. 16; 0 = no verify "
                   "function (generate --speculative needs one; not with --kv-cache state).")
@click.option("--context-buckets", default="auto", show_default=True, metavar="auto|SIZE[,SIZE...]",
              help="Cache lengths with prefill and decode functions of their own; a step runs the smallest that "
                   "holds its positions, so it reads no more of the cache than the conversation fills. auto: "
                   "powers of two from 512 up to --context-length (iOS18/macOS15); one size: the whole context.")
@click.option("--target", type=LazyChoice("llama_ane.contract.plan", "TARGETS"), default="iOS18", show_default=True,
              help="Minimum deployment target; iOS18/macOS15 give multifunction packages.")
@click.option("--precision", type=click.Choice(["fp16", "fp32"]), default="fp16", show_default=True)
@click.option("--workers", type=int, default=None,
              help="Packages built at once [default: from cores and available memory].")
@click.option("--max-memory", "max_memory", type=FiniteFloat(minimum=0, min_open=True, unit="GiB"), default=None,
              help="Memory budget in GiB, instead of what the machine reports as available; an export "
                   "estimated above it is refused before anything is converted.")
@click.option("--quantize", default="none", show_default=True, metavar="SCHEME",
              help=f"Compress the weights: {', '.join(SCHEMES)} (lutN: N-bit palettization, intN: N-bit integers), "
                   "or auto: per part and layer, the fewest bytes within --quantize-budget.")
@click.option("--quantize-budget", type=FiniteFloat(minimum=0, min_open=True, unit="percent"), default=None,
              help=f"Perplexity increase --quantize auto may spend, percent [default: {DEFAULT_BUDGET_PCT:g}].")
@click.option("--quantize-recipe", type=click.Path(path_type=Path), default=None,
              help="Compress as a recipe says: a JSON file from --quantize auto (an export's manifest.json, or "
                   "its quantization.recipe saved alone).")
@click.option("--quantize-embeddings", metavar="SCHEME", help="Scheme of the embedding table [default: --quantize].")
@click.option("--quantize-attention", metavar="SCHEME", help="Scheme of the q/k/v/o projections [default: --quantize].")
@click.option("--quantize-mlp", metavar="SCHEME", help="Scheme of the MLP projections [default: --quantize].")
@click.option("--quantize-lm-head", metavar="SCHEME", help="Scheme of the LM head [default: --quantize].")
@click.option("--group-size", type=int, default=None,
              help="Output channels sharing one LUT [default on iOS18/macOS15: "
                   f"{', '.join(f'{n} for {s}' for s, n in DEFAULT_GROUP_SIZE.items())}; 0 = one per tensor].")
@click.option("--block-size", type=int, default=None,
              help="Input channels sharing one scale [default: 32 for int4, 0 (one per output channel) for int8].")
@click.option("--lut-block-size", type=int, default=None,
              help="Scale and shift LUT values per row and block of this many input channels (iOS18/macOS15; "
                   "0 = per output channel, which the Neural Engine decompresses just in time; a block is the GPU's "
                   "form, decompressed at load on the Neural Engine) [default: 0 for lut4, plain LUTs otherwise].")
@click.option("--kv-cache", "kv_cache", type=click.Choice(["auto", "inputs", "state"]), default="auto", show_default=True,
              help="Where the KV caches live: passed in and written back by the asynchronous cache-update model "
                   "(inputs), or Core ML states the chunks update in place (state; iOS18/macOS15, fp16, no "
                   "--verify-window). auto: state where it works, else inputs.")
@click.option("--fold-lm-head", "fold_lm_head", type=click.Choice(["auto", "yes", "no"]), default="auto",
              show_default=True, help="Compute the LM head in the last chunk: one Core ML call per token fewer. "
                                      "auto: where its weights fit beside the chunk's in one package.")
@click.option("--force", is_flag=True, help="Replace OUT if it exists.")
@click.option("--no-verify", is_flag=True, help="Skip the parity check of the exported programs (and the perplexity "
                                                "check of 4-bit schemes).")
@click.option("--quiet", is_flag=True, help="No progress bar.")
@click.option("--json", "as_json", is_flag=True, help="End with one JSON object on stdout (the log goes to stderr).")
def command(model, out, revision, context_length, prefill_length, layers_per_chunk, branch_width, suffix_length,
            verify_window, context_buckets, target,
            precision, workers, max_memory, quantize, quantize_budget, quantize_recipe, quantize_embeddings,
            quantize_attention, quantize_mlp,
            quantize_lm_head, group_size, block_size, lut_block_size, kv_cache, fold_lm_head, force, no_verify, quiet, as_json):
    """Export MODEL (a Hugging Face folder or repo id, a .gguf file, or nothing for the embedded
    SmolLM2-135M-Instruct) to OUT."""
    from ..api import export_model

    t0 = time.perf_counter()
    with user_errors(), stopped_by_signal(out):
        buckets = parse_buckets(context_buckets)
        if revision is not None:  # the repo at that revision, fetched first: export_model reads its folder
            if model is None:
                raise InvalidArgumentError("--revision applies to a Hugging Face repo id given as MODEL")
            model = resolve(model, revision)
        export_model(model, out, context_length=context_length, prefill_length=prefill_length,
                     layers_per_chunk=layers_per_chunk, branch_width=branch_width,
                     suffix_length=suffix_length, verify_window=verify_window, target=target, precision=precision, force=force,
                     verify=not no_verify, workers=workers, max_memory_gb=max_memory, quantize=quantize,
                     quantize_budget=quantize_budget, quantize_recipe=quantize_recipe,
                     quantize_embeddings=quantize_embeddings, quantize_attention=quantize_attention,
                     quantize_mlp=quantize_mlp, quantize_lm_head=quantize_lm_head, group_size=group_size,
                     block_size=block_size, lut_block_size=lut_block_size, kv_cache=kv_cache, fold_lm_head=fold_lm_head, context_buckets=buckets, progress=not quiet,
                     log=_log_to_stderr if as_json else _log)
    if as_json:
        import json

        click.echo(json.dumps({"out": str(out), "seconds": round(time.perf_counter() - t0, 3),
                               "verified": not no_verify}))
        return
    click.echo(f"done in {time.perf_counter() - t0:.1f} s")


def _log(line: str) -> None:
    """A line of the export's log, printed above the progress bar rather than through it."""
    from tqdm import tqdm

    tqdm.write(line)


def _log_to_stderr(line: str) -> None:
    from tqdm import tqdm

    tqdm.write(line, file=sys.stderr)


@contextlib.contextmanager
def stopped_by_signal(out: Path) -> Iterator[None]:
    """SIGTERM and SIGHUP clean up as Ctrl-C does (the export's workers stopped, its partial folder
    removed), then end the command with one `Error:` line and the exit code a shell gives a process
    that signal ended."""
    from ..export.convert import Stopped, stop_on_signals

    try:
        with stop_on_signals():
            yield
    except Stopped as stop:
        error = click.ClickException(f"the export was {stop}; nothing was written to {out}")
        error.exit_code = 128 + stop.signum
        raise error from None


def parse_buckets(text: str) -> str | tuple[int, ...]:
    """--context-buckets: "auto", or comma-separated sizes."""
    if text.strip() == "auto":
        return "auto"
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise InvalidArgumentError(f"--context-buckets must be 'auto' or sizes such as 512,1024,2048, got {text!r}") \
            from None
