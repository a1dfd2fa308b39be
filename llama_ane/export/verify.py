"""Parity gate for an export: run a fixed real text through the exported packages and compare.

`verify_export(OUT, backend="mil")` tokenizes a few paragraphs of English prose (shipped as
`verify_text.txt`) with the export's own tokenizer, takes the first `max_tokens` tokens (at most
the context length), and scores them teacher-forced through

  * the chosen backend ("mil": the saved .mlpackage programs executed with numpy; "coreml":
    Core ML on macOS),
  * the torch backend (the very modules that were converted, in the export's precision),
  * transformers' Llama decoder layers (the reference implementation) on the same checkpoint
    weights, in float32.

For each reference it reports the max |logit difference|, the mean cosine similarity of the
per-position logit vectors ([T, vocab]) and the top-1 agreement, and fails below the thresholds.

All three are streamed so that the gate runs in about one package's memory, whatever the model's
size: the backends score chunk-major (`Pipeline.score_streamed`: every window through one model,
which is then released, before the next loads), and transformers runs one decoder layer at a time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import numpy as np

DEFAULT_MAX_TOKENS = 128
MIN_TOKENS = 16  # fewer positions say too little about an export to pass it


@dataclass(frozen=True)
class Thresholds:
    """Minimum top-1 agreement and mean cosine for one comparison to pass."""

    top1: float
    cosine: float


# Same modules, same precision: the only differences are Core ML's op lowering and fp16 rounding.
TORCH_THRESHOLDS = Thresholds(top1=0.99, cosine=0.999)
# fp16 export against the float32 reference implementation: looser by the cost of half precision.
TRANSFORMERS_THRESHOLDS = Thresholds(top1=0.95, cosine=0.995)


@dataclass
class Comparison:
    """One backend-vs-reference comparison over T positions of logits [T, vocab]."""

    reference: str
    max_abs_diff: float
    mean_cosine: float
    top1_agreement: float
    thresholds: Thresholds

    @property
    def failures(self) -> list[str]:
        out = []
        if not self.top1_agreement >= self.thresholds.top1:
            out.append(f"top-1 agreement {self.top1_agreement:.3f} < {self.thresholds.top1}")
        if not self.mean_cosine >= self.thresholds.cosine:
            out.append(f"mean cosine {self.mean_cosine:.5f} < {self.thresholds.cosine}")
        return out

    @property
    def passed(self) -> bool:
        return not self.failures


@dataclass
class VerifyReport:
    """The outcome of `verify_export`; `str(report)` is what `llama-ane verify` prints."""

    export_dir: str
    backend: str
    precision: str
    n_tokens: int = 0
    comparisons: list[Comparison] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    error: str | None = None
    method: str = ""  # which comparison ran

    @property
    def passed(self) -> bool:
        return self.error is None and bool(self.comparisons) and all(c.passed for c in self.comparisons)

    def __str__(self) -> str:
        lines = [f"verify {self.export_dir}: backend {self.backend} ({self.precision}), {self.n_tokens} tokens"]
        if self.method:
            lines.append(f"  {self.method}")
        if self.comparisons:
            lines.append(f"  {'reference':<14} {'max |diff|':>10} {'mean cos':>9} {'top-1':>6}  result")
        for c in self.comparisons:
            result = "ok" if c.passed else "FAIL: " + "; ".join(c.failures)
            lines.append(f"  {c.reference:<14} {c.max_abs_diff:>10.4f} {c.mean_cosine:>9.5f} "
                         f"{c.top1_agreement:>6.3f}  {result}")
        lines.extend(f"  {s}" for s in self.skipped)
        if self.error:
            lines.append(f"  FAILED: {self.error}")
        elif not self.passed:
            lines.append(
                f"  FAILED: the {self.backend} backend does not reproduce the reference logits. The exported "
                "packages differ from the model they were converted from: re-export with --force; if it "
                "persists, run `llama-ane inspect` on the folder and compare --backend mil with fp32 "
                "(`verify_export(..., precision='fp32')`) to tell conversion errors from fp16 rounding."
            )
        else:
            lines.append("  passed")
        return "\n".join(lines)


def default_text() -> str:
    """The fixed verification text shipped with the package (a few paragraphs of plain prose)."""
    return resources.files("llama_ane.export").joinpath("verify_text.txt").read_text(encoding="utf-8")


def top1_agreement(got: np.ndarray, want: np.ndarray) -> float:
    """Fraction of positions whose top-1 tokens agree; logits [T, vocab].

    A position agrees when the two argmax tokens are equal, or when one side's argmax is also a
    maximiser of the other side's logits: an exact tie (common when logits are stored in fp16)
    has no unique top-1, so either of the tied tokens is an agreeing choice. Near-ties are not
    forgiven: a gap of one fp16 ulp already counts as a disagreement.
    """
    a, b = got.argmax(-1), want.argmax(-1)
    rows = np.arange(got.shape[0])
    agree = (a == b) | (want[rows, a] == want.max(-1)) | (got[rows, b] == got.max(-1))
    return float(np.mean(agree))


def compare_logits(got: np.ndarray, want: np.ndarray, reference: str,
                   thresholds: Thresholds | None = None) -> Comparison:
    """Compare logits `got` and `want`, both [T, vocab]: max |diff|, mean cosine, top-1 agreement."""
    got = np.asarray(got, dtype=np.float64)
    want = np.asarray(want, dtype=np.float64)
    if got.shape != want.shape or got.ndim != 2 or got.shape[0] == 0:
        raise ValueError(f"logits of shape {got.shape} cannot be compared with {want.shape} ({reference})")
    norms = np.linalg.norm(got, axis=-1) * np.linalg.norm(want, axis=-1)
    cosine = np.sum(got * want, axis=-1) / np.maximum(norms, 1e-30)
    return Comparison(
        reference=reference,
        max_abs_diff=float(np.max(np.abs(got - want))),
        mean_cosine=float(np.mean(cosine)),
        top1_agreement=top1_agreement(got, want),
        thresholds=thresholds if thresholds is not None else Thresholds(top1=0.0, cosine=-1.0),
    )


def load_source_checkpoint(manifest: dict):
    """The checkpoint the export was made from (its path is recorded in the manifest's `source`)."""
    from .weights import load_checkpoint, source_path

    source = manifest["source"]
    return load_checkpoint(source_path(source) if source.get("kind") != "default" else None)


def transformers_logits(manifest: dict, token_ids: list[int], checkpoint=None) -> np.ndarray:
    """float32 logits [T, vocab] of transformers' Llama on the export's source weights, one layer at a time.

    The arithmetic of `LlamaForCausalLM(input_ids).logits[0]` without holding the model: the
    embedding lookup, then each `LlamaDecoderLayer` built with only its own weights in float32
    (attention "sdpa" with attention_mask=None, which is causal over the whole sequence; cos/sin
    from the model's `LlamaRotaryEmbedding`), then the final norm and the (tied or untied) LM head
    in blocks of the vocabulary. Memory: one layer's weights, one head block, activations (T, C).
    """
    import torch
    from transformers import LlamaConfig as HFLlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding

    ckpt = checkpoint if checkpoint is not None else load_source_checkpoint(manifest)
    config = {k: v for k, v in manifest["config"].items() if v is not None or k == "rope_scaling"}
    hf = HFLlamaConfig(**config)
    hf._attn_implementation = "sdpa"

    def weights(module: torch.nn.Module, prefix: str) -> torch.nn.Module:
        """`module` (built on the meta device: no random init) given checkpoint tensors `prefix + name`."""
        state = {name: ckpt.tensor(prefix + name).to(torch.float32).reshape(t.shape)
                 for name, t in module.state_dict().items()}
        module.load_state_dict(state, strict=True, assign=True)
        return module.eval()

    block = 16384  # rows of the LM head multiplied at once: (block, C) in float32
    with torch.no_grad():
        ids = torch.tensor(token_ids, dtype=torch.long)
        x = ckpt.tensor("model.embed_tokens.weight")[ids].to(torch.float32)[None]  # (1, T, C)
        positions = torch.arange(len(token_ids))[None]  # (1, T)
        rope = LlamaRotaryEmbedding(config=hf)(x, positions)  # cos, sin (1, T, D)
        for n in range(hf.num_hidden_layers):
            with torch.device("meta"):
                layer = LlamaDecoderLayer(hf, n)
            layer = weights(layer, f"model.layers.{n}.")
            x = layer(x, attention_mask=None, position_ids=positions, position_embeddings=rope)
            x = x[0] if isinstance(x, tuple) else x  # transformers 4 returns a tuple
            del layer  # before the next layer's weights are read
        with torch.device("meta"):
            norm = LlamaRMSNorm(hf.hidden_size, eps=hf.rms_norm_eps)
        h = weights(norm, "model.norm.")(x)[0]  # (T, C)
        head = ckpt.tensor("model.embed_tokens.weight" if hf.tie_word_embeddings else "lm_head.weight")  # (V, C)
        logits = torch.cat([h @ head[s:s + block].to(torch.float32).T for s in range(0, head.shape[0], block)],
                           dim=1)  # (T, V)
    return logits.numpy()


def streamed_method(n_chunks: int, with_transformers: bool) -> str:
    """The report line that says how the logits were computed."""
    line = (f"streamed: one model in memory at a time (embeddings, {n_chunks} chunk{'s' * (n_chunks != 1)}, "
            "lm_head)")
    return line + ("; transformers one decoder layer at a time" if with_transformers else "")


def verify_export(out_dir: str | Path, backend: str = "mil", text: str | None = None, *,
                  max_tokens: int = DEFAULT_MAX_TOKENS, precision: str | None = None,
                  with_transformers: bool = True,
                  torch_thresholds: Thresholds = TORCH_THRESHOLDS,
                  transformers_thresholds: Thresholds = TRANSFORMERS_THRESHOLDS,
                  checkpoint=None) -> VerifyReport:
    """Score `text` (default: the shipped prose) with `backend` and compare with torch and transformers.

    Parameters
    ----------
    out_dir : the export folder.
    backend : "mil" or "coreml".
    text : the text to score; its first `max_tokens` tokens (at most the context length) are used.
    precision : for the mil backend, "fp16" (default for fp16 exports, as the ANE computes) or "fp32".
    checkpoint : the source `Checkpoint`, when the caller has it loaded already (the exporter);
        otherwise it is loaded from the manifest's `source`.

    Returns a `VerifyReport`; it never raises for a broken export (the report says why it failed).
    """
    from ..runtime.model import load
    from .manifest import read_manifest

    out_dir = Path(out_dir)
    report = VerifyReport(str(out_dir), backend, precision or "export precision")
    if backend not in ("mil", "coreml"):
        report.error = f"--backend must be mil or coreml, not {backend!r}"
        return report
    try:
        manifest = read_manifest(out_dir)  # checks format_version and every file's sha256
    except Exception as exc:
        report.error = f"the export cannot be read: {exc}"
        return report
    export_precision = manifest["precision"]
    model = None
    try:
        options = {}
        if backend == "mil":
            options["precision"] = report.precision = precision or export_precision
        else:
            report.precision = export_precision
        model = load(out_dir, backend=backend, **options)
        ids = model.encode(text if text is not None else default_text())
        limit = min(max_tokens, int(manifest["context_length"]))
        ids = [int(t) for t in ids[:limit]]
        if len(ids) < MIN_TOKENS:
            report.error = (f"the text has {len(ids)} token(s); verification needs at least {MIN_TOKENS}: "
                            "give a longer --text")
            return report
        report.n_tokens = len(ids)
        report.method = streamed_method(len(manifest["chunks"]), with_transformers)
        got = model.pipeline.score_streamed(ids)  # [T, vocab], one model in memory at a time
    except Exception as exc:  # a broken export must give a report, not a traceback
        report.error = f"the {backend} backend could not score the text: {type(exc).__name__}: {exc}"
        return report
    finally:
        if model is not None:
            model.close()
    del model  # its pipeline's caches too, before the references load
    try:
        checkpoint = checkpoint or load_source_checkpoint(manifest)
    except Exception as exc:
        report.error = (f"the source checkpoint recorded in manifest.json ({manifest['source']}) cannot be "
                        f"loaded, and the references are built from it: {type(exc).__name__}: {exc}")
        return report
    reference = None
    try:
        # the torch reference runs the very modules that were converted, in the export's precision
        reference = load(out_dir, backend="torch", precision=export_precision, checkpoint=checkpoint)
        want = reference.pipeline.score_streamed(ids)
        report.comparisons.append(compare_logits(got, want, f"torch ({export_precision})", torch_thresholds))
    except Exception as exc:
        report.error = f"the torch reference failed: {type(exc).__name__}: {exc}"
        return report
    finally:
        if reference is not None:
            reference.close()
    del reference, want
    if with_transformers:
        try:
            hf = transformers_logits(manifest, ids, checkpoint)
        except Exception as exc:
            report.skipped.append(f"transformers: skipped, could not build the reference model "
                                  f"({type(exc).__name__}: {exc})")
        else:
            report.comparisons.append(compare_logits(got, hf, "transformers", transformers_thresholds))
    return report
