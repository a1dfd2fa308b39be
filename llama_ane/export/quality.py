"""What the exporter measures of a checkpoint beside converting it: the activation statistics that
compressed weights are fitted with (`calibrate`), and what a compression scheme costs in perplexity
on the shipped eval text (`check_quality`, and `auto_recipe` for `--quantize auto`).

Both run the checkpoint in float32 with transformers' own decoder layers (`llama_ane.reference`),
on prose shipped with the package: the calibration text, and the eval text the result is checked on.
"""

from __future__ import annotations

import time
from typing import Callable

from ..quantize import QuantizeOptions

CALIBRATION_TOKENS = (128, 512)  # fewest and most
CALIBRATION_WEIGHT_TOKENS = 1.25e11  # decoder-layer weights x tokens: a 1B-shaped model gets 128


def shipped_text(name: str) -> str:
    """A text file shipped in the package (`calibration_text.txt`, `eval_text.txt`)."""
    from importlib import resources

    return resources.files("llama_ane").joinpath(name).read_text(encoding="utf-8")


def calibration_text() -> str:
    """Prose shipped to calibrate compression on (neither the verify text nor the eval text)."""
    return shipped_text("calibration_text.txt")


def eval_text() -> str:
    """The prose a scheme's perplexity change is measured on (`llama-ane eval`'s default text)."""
    return shipped_text("eval_text.txt")


def calibration_tokens(config) -> int:
    """How many calibration tokens a model gets: its float32 pass costs layer weights x tokens, so
    larger models get fewer, down to 128 (SmolLM2-135M: 512; Llama-3.2-1B, 3B and 8B: 128).
    The statistics are per-channel mean squares, which a few hundred tokens already settle."""
    from ..contract.plan import layer_weight_bytes  # (the planner sizes chunks by it)

    weights = layer_weight_bytes(config, 1) * config.num_hidden_layers
    fewest, most = CALIBRATION_TOKENS
    return max(fewest, min(most, int(CALIBRATION_WEIGHT_TOKENS // max(weights, 1))))


def text_ids(ckpt, text: str, tokens: int) -> list[int]:
    """The first `tokens` token ids of `text` (those inside the model's vocabulary)."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(ckpt.tokenizer_dir))(text).input_ids[:tokens]
    return [i for i in ids if i < ckpt.config.vocab_size]


def sensitivity_ids(ckpt) -> list[int]:
    """The tokens `--quantize auto` measures each unit on: SENSITIVITY_TOKENS of the calibration
    text after those `calibrate` reads. Compensated codes are chosen against the statistics of
    those it reads, and fit them better than other text: measured on them, a compensated unit
    would look cheaper than it is."""
    from ..quantize.auto import SENSITIVITY_TOKENS

    skip = calibration_tokens(ckpt.config)
    return text_ids(ckpt, calibration_text(), skip + SENSITIVITY_TOKENS)[skip:]


def calibrate(ckpt, say: Callable[[str], None], on_found: Callable[[str, object], None] | None = None,
              grams: bool = False) -> dict:
    """The activation statistics LUT fits and int4 ranges are weighted by: the checkpoint run in
    float32, one layer at a time, on the first `calibration_tokens(config)` tokens of
    `calibration_text` (with `grams`, also each projection's input second moments, which
    error-compensated LUT codes are chosen against).
    `on_found(key, array)` gets each layer's as soon as it is known (see activation_importance).
    The exporter runs it as one of its worker jobs, beside the compression it feeds."""
    from ..reference import activation_importance

    t0 = time.perf_counter()
    ids = text_ids(ckpt, calibration_text(), calibration_tokens(ckpt.config))
    importance = activation_importance(ckpt, ids, on_found, grams)
    say(f"calibrated on {len(ids)} tokens in {time.perf_counter() - t0:.1f} s")
    return importance


def unmeasured(ckpt) -> bool:
    """Whether the quality model (transformers' decoder layers on the checkpoint's weights) is not
    this family's whole network (families/: `Family.quality_model`)."""
    return not ckpt.config.family.quality_model


def quality_model(ckpt):
    """The checkpoint as a float32 quantize.sensitivity.Float32Model, every layer in memory (own
    copies: the measurements swap weights in place)."""
    import torch

    from ..quantize.sensitivity import Float32Model
    from ..reference import _with_weights, family_classes, hf_config

    hf, (DecoderLayer, RMSNorm, Rotary) = hf_config(ckpt.config), family_classes(ckpt.config.model_type)
    layers = []
    for n in range(hf.num_hidden_layers):
        with torch.device("meta"):
            layer = DecoderLayer(hf, n)
        layer = _with_weights(ckpt, layer, f"model.layers.{n}.")
        for p in layer.parameters():
            p.data = p.data.clone()
        layers.append(layer)
    with torch.device("meta"):
        norm = RMSNorm(hf.hidden_size, eps=hf.rms_norm_eps)
    table = ckpt.tensor("model.embed_tokens.weight").to(torch.float32).clone()
    head = table.clone() if hf.tie_word_embeddings else ckpt.tensor("lm_head.weight").to(torch.float32).clone()
    return Float32Model(table, layers, _with_weights(ckpt, norm, "model.norm."), head, Rotary(config=hf))


def auto_recipe(ckpt, budget_pct: float, say: Callable[[str], None], progress: bool = False):
    """`--quantize auto`: the recipe of fewest bytes within `budget_pct` (quantize.auto), measured
    on the calibration text and checked on the eval text. `progress`: each phase (calibration, the
    units' measurement, each choice's check) shows its steps done and an ETA (export.progress.StepProgress)."""
    import functools

    from ..quantize.auto import CANDIDATES, CHECK_TOKENS
    from ..quantize.schemes import QuantizeError
    from .progress import StepProgress

    if unmeasured(ckpt):
        raise QuantizeError(f"--quantize auto cannot measure a {ckpt.config.model_type} checkpoint yet; choose a "
                            "scheme (e.g. --quantize lut6) and check it with llama-ane eval")
    from ..quantize.sensitivity import choose_recipe

    phase = functools.partial(StepProgress, enabled=progress, say=say)
    layers = ckpt.config.num_hidden_layers
    bar = phase("auto: calibrating", layers, unit="layer")
    seen: set[str] = set()

    def on_found(key: str, _value) -> None:  # a layer's first key: the one before it is done; "heads": the last
        layer = key.split(".")[1] if key.startswith("layers.") else key
        if layer not in seen:
            seen.add(layer)
            if len(seen) > 1:
                bar.advance(f"layer {len(seen) - 1} of {layers}")
    try:
        importance = calibrate(ckpt, say, on_found, grams=any(c.compensated for c in CANDIDATES))
    finally:
        bar.close()
    return choose_recipe(quality_model(ckpt), sensitivity_ids(ckpt),
                         text_ids(ckpt, eval_text(), CHECK_TOKENS), importance, budget_pct, "the eval text", say,
                         phase=phase)


def check_quality(ckpt, quantize: QuantizeOptions, target: str, say: Callable[[str], None]) -> float:
    """Measure a fixed scheme of 4 bits or fewer on the eval text and say the perplexity change;
    beyond WARN_PCT, say so plainly and what to use instead."""
    if unmeasured(ckpt):
        say(f"quality: not measured for {ckpt.config.model_type} checkpoints; check it with llama-ane eval")
        return float("nan")
    from ..quantize.auto import CHECK_TOKENS, DEFAULT_BUDGET_PCT, WARN_PCT, part_of_unit, units
    from ..quantize.sensitivity import perplexity_change

    forms = {u: quantize.compression(part_of_unit(u), target, None if quantize.recipe is None else u)
             for u in units(ckpt.config.num_hidden_layers)}
    ids = text_ids(ckpt, eval_text(), CHECK_TOKENS)
    grams = any(c is not None and c.compensated for c in forms.values())
    change = perplexity_change(quality_model(ckpt), forms, ids, calibrate(ckpt, say, grams=grams))
    say(f"quality: perplexity {change:+.2f}% against fp16 on {len(ids)} tokens of the eval text")
    if change > WARN_PCT:
        say(f"warning: these weights lose {change:.0f}% perplexity (more than {WARN_PCT:g}%). Use --quantize auto "
            f"(the fewest bytes within --quantize-budget, default {DEFAULT_BUDGET_PCT:g}%), a larger scheme, or, "
            "for a GPU deployment on macOS, a LUT scaled per block (--lut-block-size 32, or the block size of a "
            "GGUF source)")
    return change
