"""`llama-ane gpu-generate`: shared-prefix batch decoding on an NVIDIA GPU with the Triton kernels.

Needs only torch, triton and transformers (no coremltools), so it stays importable on a GPU box.
"""

from __future__ import annotations

import json

import click

from .errors import user_errors
from .options import TEXT, PathOrRepo, revision_option

DEFAULT_BRANCHES = (
    "Question: What is the capital of France?\nAnswer:",
    "Question: Name three primary colors.\nAnswer:",
    "Question: What is 12 times 12?\nAnswer:",
    "Question: Who wrote Hamlet?\nAnswer:",
)
DEFAULT_PROMPT = ("You are a helpful assistant. Answer each question in one short sentence, "
                  "accurately and without extra commentary. The answers will be read by a "
                  "student who is preparing for a general knowledge quiz, so be precise.\n\n")


@click.command("gpu-generate")
@click.argument("model_dir", required=False, type=PathOrRepo())
@revision_option("MODEL_DIR")
@click.option("--gguf-file", default=None, help="GGUF file name inside MODEL_DIR.")
@click.option("--prompt", type=TEXT, default=DEFAULT_PROMPT, help="Shared prefix text of every branch.")
@click.option("--branch", "branches", type=TEXT, multiple=True,
              help="Text of one branch after the shared prompt (repeatable).")
@click.option("--max-new-tokens", default=32, show_default=True)
@click.option("--path", "attn_path", type=click.Choice(["auto", "cascade", "decode"]),
              default="auto", show_default=True, help="Attention path (auto = cost model).")
@click.option("--dtype", type=click.Choice(["fp16", "bf16"]), default="fp16", show_default=True)
@click.option("--page-size", default=16, show_default=True)
@click.option("--check", is_flag=True,
              help="Also decode with the cascade and with plain paged decode (both forced) and "
                   "report whether their tokens agree.")
@click.option("--eager", is_flag=True,
              help="Launch every kernel from Python at every step instead of replaying the "
                   "decode step as a CUDA graph.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def command(model_dir, revision, gguf_file, prompt, branches, max_new_tokens, attn_path, dtype, page_size,
            check, eager, as_json):
    """Decode several branches that share PROMPT on the GPU (default model: SmolLM2-135M); MODEL_DIR is a
    llama folder or a Hugging Face repo id of a checkpoint."""
    try:
        import torch
    except ImportError as e:  # pragma: no cover - torch is a dependency
        raise click.ClickException(f"gpu-generate needs torch: {e}") from None
    if not torch.cuda.is_available():
        raise click.ClickException("gpu-generate needs an NVIDIA GPU with CUDA; torch sees none "
                                   "(torch.cuda.is_available() is False)")
    try:
        import triton  # noqa: F401
    except ImportError:
        raise click.ClickException("gpu-generate needs triton (pip install triton)") from None

    from ..cuda.engine import GPUEngine, load_hf_model
    from ..hub import locate

    with user_errors():
        model_dir = locate(model_dir, revision, "checkpoint")
    try:
        model, tokenizer = load_hf_model(model_dir, gguf_file)
    except (OSError, ValueError) as e:
        raise click.ClickException(f"could not load a llama model from {model_dir}: {e}") from None
    if tokenizer is None:
        raise click.ClickException(f"{model_dir} has no tokenizer; gpu-generate needs one")
    engine = GPUEngine(model, dtype=torch.float16 if dtype == "fp16" else torch.bfloat16,
                       page_size=page_size)
    branches = list(branches) or list(DEFAULT_BRANCHES)
    prompt_ids = tokenizer(prompt)["input_ids"]
    branch_ids = [tokenizer(b, add_special_tokens=False)["input_ids"] for b in branches]
    try:
        graph = not eager
        result = engine.generate(prompt_ids, branch_ids, max_new_tokens, path=attn_path,
                                 cuda_graph=graph)
        pair = None
        if check:  # both paths forced; the run above already is one of them when it was forced
            pair = tuple(result if attn_path == p else
                         engine.generate(prompt_ids, branch_ids, max_new_tokens, path=p,
                                         cuda_graph=graph) for p in ("cascade", "decode"))
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    texts = [tokenizer.decode(t, skip_special_tokens=True) for t in result.tokens]
    out = dict(branches=[dict(branch=b, text=t, tokens=ids)
                         for b, t, ids in zip(branches, texts, result.tokens)],
               paths=result.paths_used, steps=result.steps,
               tokens_per_second=result.tokens_per_second)
    if pair is not None:
        out["cascade_identical_to_plain_decode"] = pair[0].tokens == pair[1].tokens
    if as_json:
        click.echo(json.dumps(out, indent=1))
        return
    for b, t in zip(branches, texts):
        click.echo(f"--- {b!r}\n{t}")
    click.echo(f"\n{len(branches)} branches, {result.steps} steps, attention paths "
               f"{result.paths_used}: {result.tokens_per_second:.1f} tokens/s")
    if pair is not None:
        click.echo("forced cascade tokens identical to forced plain decode: "
                   f"{out['cascade_identical_to_plain_decode']}")
