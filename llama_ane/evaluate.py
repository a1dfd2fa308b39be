"""`llama-ane eval`: the quality an export gives, as perplexity on held-out text, and how far it
moves from another export of the same model (top-1 agreement, mean KL divergence).

The text (default: `eval_text.txt`, about 2100 SmolLM2 tokens of prose written for this project,
so no model has seen it) is tokenized once and cut into consecutive windows of at most the
export's context length; each window is scored teacher-forced from position 0, and every token
after the first of its window is predicted from the ones before it. Perplexity is
exp(mean negative log-likelihood) over those predictions, computed in float64 from the logits the
backend returns. With a reference export, the same windows go through it, and for each predicted
position the report gives whether the two top-1 tokens agree and KL(reference || this export).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path

import numpy as np

from .errors import InvalidArgumentError

MIN_TOKENS = 32


def default_eval_text() -> str:
    """The held-out prose shipped with the package."""
    return resources.files("llama_ane").joinpath("eval_text.txt").read_text(encoding="utf-8")


@dataclass
class EvalReport:
    """What `llama-ane eval` prints (`str`) or writes (`to_dict`, with --json)."""

    export_dir: str
    backend: str
    precision: str
    tokens: int  # tokens of text scored
    windows: int
    predictions: int  # positions whose next token was predicted
    perplexity: float
    reference: str | None = None
    reference_perplexity: float | None = None
    top1_agreement: float | None = None
    mean_kl: float | None = None  # KL(reference || this export), nats per position
    quantization: dict | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        from .quantize.auto import weights_label

        schemes = weights_label(self.quantization) if self.quantization else ""
        lines = [f"eval {self.export_dir}: backend {self.backend} ({self.precision})"
                 + (f"; weights: {schemes}" if schemes else ""),
                 f"  {self.tokens} tokens in {self.windows} window(s), {self.predictions} predictions",
                 f"  perplexity {self.perplexity:.4f}"]
        if self.reference is not None:
            change = 100 * (self.perplexity / self.reference_perplexity - 1)
            lines += [f"  reference {self.reference}: perplexity {self.reference_perplexity:.4f} ({change:+.2f}%)",
                      f"  top-1 agreement {self.top1_agreement:.4f}, mean KL {self.mean_kl:.5f} nats"]
        return "\n".join(lines)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """float64 log-probabilities of logits [T, V]."""
    x = logits.astype(np.float64)
    x -= x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def windows_of(ids: list[int], size: int) -> list[list[int]]:
    """Consecutive windows of at most `size` tokens; a last window of one token predicts nothing
    and is dropped."""
    return [ids[s:s + size] for s in range(0, len(ids), size) if len(ids[s:s + size]) > 1]


def evaluate(out_dir: str | Path, text: str | None = None, *, backend: str = "auto", precision: str | None = None,
             reference: str | Path | None = None, window: int | None = None, progress: bool = False) -> EvalReport:
    """Perplexity of the export at `out_dir` on `text` (default: the shipped held-out prose), and,
    with `reference` (another export of the same model, e.g. its fp16 one), top-1 agreement and
    mean KL divergence against it. `window` caps the window length (default: the context length).
    `progress`: say what is loaded and scored at once, and show the windows with an ETA (stderr)."""
    import sys

    from .contract.manifest import read_manifest
    from .runtime.model import load
    from .verify import StepBar, top1_agreement

    out_dir = Path(out_dir)
    if progress:
        print(f"eval {out_dir}: loading ({backend})...", file=sys.stderr, flush=True)
    manifest = read_manifest(out_dir)
    options = {} if precision is None else {"precision": precision}
    model = load(out_dir, backend=backend, **options)
    ref_model = None
    try:
        if reference is not None:
            ref_manifest = read_manifest(reference)
            if ref_manifest["config"] != manifest["config"]:
                raise InvalidArgumentError(f"--reference {reference} is an export of another model (its config differs); "
                                 "give an export of the same checkpoint")
            ref_model = load(reference, backend=backend, **options)
        ids = model.encode(text if text is not None else default_eval_text())
        if len(ids) < MIN_TOKENS:
            raise InvalidArgumentError(f"the text has {len(ids)} tokens; perplexity needs at least {MIN_TOKENS}: give a longer "
                             "--text")
        size = min(window or manifest["context_length"], manifest["context_length"])
        if size < 2:
            raise InvalidArgumentError(f"--window must be at least 2 tokens, got {size}")
        nll, ref_nll, agree, kl = [], [], [], []
        parts = windows_of(ids, size)
        half = model.backend.dtype == np.float16
        bar = StepBar(len(ids), "eval", progress, unit="tok")
        bar.say(f"eval {out_dir}: {len(ids)} tokens in {len(parts)} window(s) of up to {size}"
                + (f", each through this export and {reference}" if ref_model is not None else ""))
        for part in parts:
            target = np.asarray(part[1:])
            with bar.step(f"{len(part)}-token window", len(part)):
                logits = model.score(part)[:-1]  # [n-1, V]: position t predicts token t+1
                if ref_model is not None:
                    ref_logits = ref_model.score(part)[:-1]
            logp = log_softmax(logits)
            nll.append(-logp[np.arange(len(target)), target])
            if ref_model is not None:
                ref_logp = log_softmax(ref_logits)
                ref_nll.append(-ref_logp[np.arange(len(target)), target])
                agree.append(top1_agreement(logits, ref_logits, np.float16 if half else np.float32) * len(target))
                kl.append((np.exp(ref_logp) * (ref_logp - logp)).sum(axis=-1))
        bar.close()
        predictions = sum(len(n) for n in nll)
        report = EvalReport(str(out_dir), model.backend.name, "fp16" if half else "fp32", len(ids), len(parts),
                            predictions, float(np.exp(np.concatenate(nll).mean())),
                            quantization=manifest.get("quantization"))
        if ref_model is not None:
            report.reference = str(reference)
            report.reference_perplexity = float(np.exp(np.concatenate(ref_nll).mean()))
            report.top1_agreement = float(sum(agree) / predictions)
            report.mean_kl = float(np.concatenate(kl).mean())
        return report
    finally:
        model.close()
        if ref_model is not None:
            ref_model.close()
