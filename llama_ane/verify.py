"""Parity gate for an export: run a fixed real text through the exported packages and compare.

`verify_export(OUT, backend="mil")` tokenizes a few paragraphs of English prose (shipped as
`verify_text.txt`) with the export's own tokenizer, takes the first `max_tokens` tokens (at most
the context length), and scores them teacher-forced through

  * the chosen backend ("mil": the saved .mlpackage programs executed with numpy; "coreml":
    Core ML on macOS), in the export's precision, and with mil in float32 too,
  * the torch backend (the modules the programs are written from), in float32 against the mil
    backend's float32 run: the conversion check,
  * transformers' Llama decoder layers (the reference implementation) on the checkpoint's weights,
    in float32, against the backend in the export's precision: the check of the whole.

For each reference it reports the max |logit difference|, the mean cosine similarity of the
per-position logit vectors ([T, vocab]) and the top-1 agreement, and fails below the thresholds.

All three are streamed so that the gate runs in about one package's memory, whatever the model's
size: the backends score chunk-major (`Pipeline.score_streamed`: every window through one model,
which is then released, before the next loads), and transformers runs one decoder layer at a time.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Iterator

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
# fp16 export against the float32 reference implementation: looser by the cost of half precision,
# and for a compressed export by the cost of its most lossy scheme (measured on SmolLM2, README).
TRANSFORMERS_THRESHOLDS = Thresholds(top1=0.95, cosine=0.995)
SCHEME_THRESHOLDS = {
    "int8": Thresholds(top1=0.90, cosine=0.99),
    "lut8": Thresholds(top1=0.90, cosine=0.99),
    "lut6": Thresholds(top1=0.80, cosine=0.98),
    "int4": Thresholds(top1=0.60, cosine=0.95),
    "lut4": Thresholds(top1=0.30, cosine=0.80),
}
LOSS_ORDER = ("none", "int8", "lut8", "lut6", "int4", "lut4")  # least to most lossy


def compressed_schemes(manifest: dict) -> list[str]:
    """The schemes of an export's compressed parts (empty for dense weights)."""
    return sorted({d["scheme"] for d in manifest.get("quantization", {}).values()} - {"none"}, key=LOSS_ORDER.index)


def transformers_thresholds_for(manifest: dict) -> Thresholds:
    """The transformers comparison's thresholds: fp16's, or those of the most lossy scheme."""
    schemes = compressed_schemes(manifest)
    return SCHEME_THRESHOLDS[schemes[-1]] if schemes else TRANSFORMERS_THRESHOLDS


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
    resolution: str = "float32"  # the precision whose ulps bound a top-1 tie (see top1_agreement)

    @property
    def passed(self) -> bool:
        return self.error is None and bool(self.comparisons) and all(c.passed for c in self.comparisons)

    @property
    def partial(self) -> bool:
        """The gate left a reference out by request (--no-transformers): it checked the conversion only."""
        return bool(self.skipped)

    def __str__(self) -> str:
        lines = [f"verify {self.export_dir}: backend {self.backend} ({self.precision}), {self.n_tokens} tokens"]
        if self.method:
            lines.append(f"  {self.method}")
        width = max([14] + [len(c.reference) for c in self.comparisons])
        if self.comparisons:
            lines.append(f"  top-1 counts a pick within {TIE_ULPS} {self.resolution} ulps of the best logit as agreeing")
            lines.append(f"  {'reference':<{width}} {'max |diff|':>10} {'mean cos':>9} {'top-1':>6}  result")
        for c in self.comparisons:
            result = "ok" if c.passed else "FAIL: " + "; ".join(c.failures)
            lines.append(f"  {c.reference:<{width}} {c.max_abs_diff:>10.4f} {c.mean_cosine:>9.5f} "
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
        elif self.partial:
            lines.append("  passed, partially: only the conversion was checked, not the whole model")
        else:
            lines.append("  passed")
        return "\n".join(lines)


class StepBar:
    """One progress line over a fixed number of named steps, with tqdm's ETA, on stderr; what a
    step says goes through tqdm.write so the bar is never broken. Disabled: it says nothing."""

    def __init__(self, steps: int, desc: str, enabled: bool, unit: str = "step"):
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=steps, desc=desc, unit=unit, dynamic_ncols=True, leave=False, file=sys.stderr)

    def say(self, line: str) -> None:
        if self.bar is not None:
            self.bar.write(line, file=sys.stderr)

    @contextlib.contextmanager
    def step(self, what: str, count: int = 1) -> Iterator[None]:
        """Show `what` while the body runs, then count `count` steps done."""
        if self.bar is not None:
            self.bar.set_postfix_str(what)
        yield
        if self.bar is not None:
            self.bar.update(count)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


SKIP_TRANSFORMERS = "--no-transformers"  # the one way past a reference that cannot be built, bar --no-verify


def reference_failure(exc: BaseException) -> str:
    """The gate's error when transformers' model of the family cannot be built or run: the cause,
    the installed transformers against the range llama-ane is tested with, and the ways on."""
    from importlib import metadata

    from packaging.requirements import Requirement

    cause = f"the transformers reference could not be built ({type(exc).__name__}: {exc})"
    skip = f"pass {SKIP_TRANSFORMERS} to check the conversion only"
    try:
        installed = metadata.version("transformers")
        tested = next(r.specifier for r in map(Requirement, metadata.requires("llama-ane") or [])
                      if r.name == "transformers")
    except (metadata.PackageNotFoundError, StopIteration):
        return f"{cause}: install transformers, or {skip}"
    if not tested.contains(installed, prereleases=True):
        return (f"{cause}; transformers {installed} is installed, llama-ane is tested with {tested}: "
                f"pip install 'transformers{tested}', or {skip}")
    return f"{cause}; transformers {installed} is in the tested range ({tested}), so please report it; {skip}"


def default_text() -> str:
    """The fixed verification text shipped with the package (a few paragraphs of plain prose)."""
    return resources.files("llama_ane").joinpath("verify_text.txt").read_text(encoding="utf-8")


TIE_ULPS = 2  # logits this many units in the last place apart cannot be ordered at that precision


def top1_agreement(got: np.ndarray, want: np.ndarray, resolution: type = np.float32) -> float:
    """Fraction of positions whose top-1 tokens agree; logits [T, vocab].

    A position agrees when the two argmax tokens are equal, or when one side ranks the other's pick
    within TIE_ULPS units in the last place of `resolution` (np.float16 for an fp16 export) of its
    own best logit. Logits that close have no order at that precision: each of the two compared
    logits is rounded to it (half an ulp each), on each side. With float32 this leaves only exact
    ties (common when logits are stored in fp16); a near-tie by fp16 resolution then counts as a
    disagreement.
    """
    a, b = got.argmax(-1), want.argmax(-1)
    rows = np.arange(got.shape[0])

    def tolerance(x: np.ndarray) -> np.ndarray:
        peak = np.abs(x).max(-1).astype(resolution)
        return TIE_ULPS * np.spacing(peak).astype(np.float64)

    agree = ((a == b) | (want[rows, a] >= want.max(-1) - tolerance(want))
             | (got[rows, b] >= got.max(-1) - tolerance(got)))
    return float(np.mean(agree))


def compare_logits(got: np.ndarray, want: np.ndarray, reference: str,
                   thresholds: Thresholds | None = None, resolution: type = np.float32) -> Comparison:
    """Compare logits `got` and `want`, both [T, vocab]: max |diff|, mean cosine, top-1 agreement
    (ties at `resolution`, see `top1_agreement`)."""
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
        top1_agreement=top1_agreement(got, want, resolution),
        thresholds=thresholds if thresholds is not None else Thresholds(top1=0.0, cosine=-1.0),
    )


def load_source_checkpoint(manifest: dict):
    """The checkpoint the export was made from (its path is recorded in the manifest's `source`)."""
    from .checkpoint.loader import load_checkpoint, source_path

    source = manifest["source"]
    return load_checkpoint(source_path(source) if source.get("kind") != "default" else None)


def reference_modules(ckpt, manifest: dict, model: str) -> dict:
    """The torch modules of manifest `model` ({function: module}) on `ckpt`'s weights in the export's
    precision: the reference this gate compares with, and what `--target coreai` converts."""
    import torch

    from .runtime.backends.torch_modules import CheckpointWeights, build_model

    dtype = torch.float16 if manifest["precision"] == "fp16" else torch.float32
    modules = build_model(CheckpointWeights(ckpt), manifest, model, dtype)
    for module in {id(m): m for m in modules.values()}.values():
        module.to(dtype)  # the RoPE tables are made in float32; index buffers stay int32
    return modules


def streamed_method(n_chunks: int, with_transformers: bool) -> str:
    """The report line that says how the logits were computed."""
    line = (f"streamed: one model in memory at a time (embeddings, {n_chunks} chunk{'s' * (n_chunks != 1)}, "
            "lm_head)")
    return line + ("; transformers one decoder layer at a time" if with_transformers else "")


def _scored(out_dir: Path, backend: str, ids: list[int], **options) -> np.ndarray:
    """Teacher-forced logits [T, vocab] of `ids` through the export with `backend`, streamed."""
    from .runtime.model import load

    model = load(out_dir, backend=backend, **options)
    try:
        return model.pipeline.score_streamed(ids, every_bucket=True)  # one model in memory at a time
    finally:
        model.close()


def text_tree(ids: list[int]) -> tuple[list[int], list[int]]:
    """A token tree of len(ids) tokens taken from a text: ids[0] is the root, the first half of the
    rest a chain under it, the second half another chain under it. Returns (tokens, parents)."""
    half = 1 + (len(ids) - 1) // 2
    parents = [-1] + [i - 1 if i > 1 else 0 for i in range(1, half)]
    parents += [0] + [i - 1 for i in range(half + 1, len(ids))]
    return list(ids), parents[:len(ids)]


def _tree_logits(out_dir: Path, backend: str, ids: list[int], **options) -> np.ndarray:
    """Logits [W, vocab] of the "verify" function on `text_tree(ids)` at position 0 (an empty
    cache), one model in memory at a time."""
    from .model import names as N
    from .runtime.model import load

    tokens, parents = text_tree(ids)
    depth = np.zeros(len(ids), np.int32)
    allowed = np.eye(len(ids), dtype=bool)
    for i, p in enumerate(parents):
        if p >= 0:
            depth[i], allowed[i] = depth[p] + 1, allowed[i] | allowed[p]
    model = load(out_dir, backend=backend, **options)
    try:
        pipe, dtype = model.pipeline, model.backend.dtype  # a new pipeline: its caches are empty
        inputs = {N.INPUT_IDS: np.array([tokens], np.int32), N.POSITION: np.zeros(1, np.int32), N.DEPTHS: depth,
                  N.TREE_MASK: np.where(allowed, 0.0, -1.0e4).astype(dtype).reshape(1, 1, len(ids), len(ids))}
        return pipe.forward("verify", inputs, lambda *_: None, visible=0, release=True)
    finally:
        model.close()


def verify_export(out_dir: str | Path, backend: str = "mil", text: str | None = None, *,
                  max_tokens: int = DEFAULT_MAX_TOKENS, precision: str | None = None,
                  with_transformers: bool = True, ane_numerics: bool = False,
                  torch_thresholds: Thresholds = TORCH_THRESHOLDS,
                  transformers_thresholds: Thresholds | None = None,
                  checkpoint=None, progress: bool = False) -> VerifyReport:
    """Score `text` (default: the shipped prose) with `backend` and compare with torch and transformers.

    Parameters
    ----------
    out_dir : the export folder.
    backend : "mil", "coreml" or "coreai" (an --target coreai export, run by coreai-core's runtime).
    text : the text to score; its first `max_tokens` tokens (at most the context length) are used.
    precision : for the mil backend, "fp16" (default for fp16 exports, as the ANE computes) or "fp32".
    checkpoint : the source `Checkpoint`, when the caller has it loaded already (the exporter);
        otherwise it is loaded from the manifest's `source`.
    transformers_thresholds : default: fp16's, or for a compressed export those of its most lossy
        scheme (SCHEME_THRESHOLDS).
    progress : say at once what is checked, and show each step with an ETA (stderr).
    ane_numerics : mil backend, fp16 export: also score the programs with the Neural Engine's
        reported deviations (`llama_ane.mil.numerics`) against transformers, at the same thresholds.

    Two comparisons. The conversion: with the mil backend, the programs executed in float32 against
    the torch modules they are written from in float32, so that nothing but a conversion error
    can separate them (with the coreml backend, Core ML's own precision against torch in the
    export's). The torch modules read the checkpoint's weights, rounded to the export's precision
    as it stores them, for a dense export (checking the weight mapping too), and the export's own
    decompressed weights for a compressed one. The whole: the backend in the export's
    precision (fp16, as the ANE computes) against transformers on the checkpoint in float32.

    Returns a `VerifyReport`; it never raises for a broken export (the report says why it failed).
    """
    out_dir = Path(out_dir)
    bar = StepBar(8 if ane_numerics else 7, "verify", progress)
    bar.say(f"verify {out_dir}: scoring {max_tokens} tokens of text with the {backend} backend, against torch"
            + (" and transformers" if with_transformers else "") + "...")
    try:
        return _verify(out_dir, backend, text, max_tokens, precision, with_transformers, torch_thresholds,
                       transformers_thresholds, checkpoint, bar, ane_numerics)
    finally:
        bar.close()


def _verify(out_dir: Path, backend: str, text: str | None, max_tokens: int, precision: str | None,
            with_transformers: bool, torch_thresholds: Thresholds, transformers_thresholds: Thresholds | None,
            checkpoint, bar: StepBar, ane_numerics: bool = False) -> VerifyReport:
    from .contract.manifest import read_manifest
    from .reference import transformers_logits
    from .runtime.model import load

    report = VerifyReport(str(out_dir), backend, precision or "export precision")
    if backend not in ("mil", "coreml", "coreai"):
        report.error = f"--backend must be mil, coreml or coreai, not {backend!r}"
        return report
    try:
        manifest = read_manifest(out_dir)  # checks format_version and every file's sha256
    except Exception as exc:
        report.error = f"the export cannot be read: {exc}"
        return report
    export_precision = manifest["precision"]
    if ane_numerics and (backend != "mil" or export_precision != "fp16" or (precision or "fp16") != "fp16"
                         or not with_transformers):
        report.error = ("--ane-numerics runs an fp16 export's programs on the mil backend in fp16 against "
                        "transformers: use --backend mil, no --precision fp32, and drop --no-transformers")
        return report
    options = {}
    if backend == "mil":
        options["precision"] = report.precision = precision or export_precision
        options["widen_weights"] = False  # one copy of a package's weights: the gate's memory bound
    else:
        report.precision = export_precision
    try:
        with bar.step("reading the tokenizer"):
            model = load(out_dir, backend=backend, **options)
            try:
                ids = model.encode(text if text is not None else default_text())
            finally:
                model.close()
        ids = [int(t) for t in ids[:min(max_tokens, int(manifest["context_length"]))]]
        if len(ids) < MIN_TOKENS:
            report.error = (f"the text has {len(ids)} token(s); verification needs at least {MIN_TOKENS}: "
                            "give a longer --text")
            return report
        report.n_tokens = len(ids)
        resolution = np.float16 if report.precision == "fp16" else np.float32  # of the logits scored
        report.resolution = np.dtype(resolution).name
        report.method = streamed_method(len(manifest["chunks"]), with_transformers)
        if backend == "mil":
            report.method += ("\n  torch: the programs run in fp32 against the torch modules in fp32 on the same weights "
                              "(the conversion)" + (f"; transformers: the programs in {report.precision} against the "
                                                    "checkpoint in fp32 (the whole)" if with_transformers else ""))
        with bar.step(f"the {backend} backend in {report.precision}"):
            got = _scored(out_dir, backend, ids, **options)  # [T, vocab]
        # the conversion check runs the programs in float32 (unless they already ran in it)
        conversion_precision = "fp32" if backend == "mil" else export_precision
        got_conversion = got
        with bar.step(f"the {backend} backend in fp32"):
            if backend == "mil" and options["precision"] != "fp32":
                got_conversion = _scored(out_dir, backend, ids, precision="fp32", widen_weights=False)
    except Exception as exc:  # a broken export must give a report, not a traceback
        report.error = f"the {backend} backend could not score the text: {type(exc).__name__}: {exc}"
        return report
    try:
        with bar.step("loading the source checkpoint"):
            checkpoint = checkpoint or load_source_checkpoint(manifest)
    except Exception as exc:
        report.error = (f"the source checkpoint recorded in manifest.json ({manifest['source']}) cannot be "
                        f"loaded, and the references are built from it: {type(exc).__name__}: {exc}")
        return report
    compressed = compressed_schemes(manifest)
    # Core AI assets keep their palettized weights in the program, which the torch modules cannot
    # read: they compare with the dense checkpoint, at the scheme's thresholds
    dense_reference = backend == "coreai" and bool(compressed)
    if dense_reference:
        torch_thresholds = transformers_thresholds_for(manifest)
        compressed = []
    try:
        # the modules the programs are written from, on the checkpoint's weights (the export's own
        # when they are compressed)
        with bar.step(f"the torch modules in {conversion_precision}"):
            want = _scored(out_dir, "torch", ids, precision=conversion_precision,
                           **({} if compressed else {"checkpoint": checkpoint, "weights_precision": export_precision}))
        label = f"torch ({conversion_precision}{', same weights' if compressed else ''})"
        report.comparisons.append(compare_logits(got_conversion, want, label, torch_thresholds,
                                                 np.float16 if conversion_precision == "fp16" else np.float32))
    except Exception as exc:
        report.error = f"the torch reference failed: {type(exc).__name__}: {exc}"
        return report
    del want, got_conversion
    window = int(manifest.get("verify_window", 0))
    if window and len(ids) >= window:
        try:  # the verify function (speculative decoding): a token tree from the text, the same two backends
            conversion = {"precision": "fp32", "widen_weights": False} if backend == "mil" else {}
            reference = {} if compressed else {"checkpoint": checkpoint, "weights_precision": export_precision}
            with bar.step(f"the verify function on a tree of {window}"):
                tree = _tree_logits(out_dir, backend, ids[:window], **conversion)
                want = _tree_logits(out_dir, "torch", ids[:window], precision=conversion_precision, **reference)
            report.comparisons.append(compare_logits(tree, want, f"{label}, verify tree of {window}", torch_thresholds,
                                                     np.float16 if conversion_precision == "fp16" else np.float32))
        except Exception as exc:
            report.error = f"the verify function could not be checked: {type(exc).__name__}: {exc}"
            return report
    if not with_transformers:
        report.skipped.append(f"transformers: skipped by {SKIP_TRANSFORMERS}")
    else:
        try:
            with bar.step("transformers, one layer at a time"):
                hf = transformers_logits(ids, checkpoint)
        except Exception as exc:  # a gate that quietly did half its job would still say "passed"
            report.error = reference_failure(exc)
            return report
        else:
            thresholds = transformers_thresholds or transformers_thresholds_for(manifest)
            report.comparisons.append(compare_logits(got, hf, "transformers" + (f" ({'/'.join(compressed)})" if compressed
                                                                                else ""), thresholds, resolution))
            if ane_numerics:
                try:
                    with bar.step("the programs with the Neural Engine's reported numerics"):
                        ane = _scored(out_dir, "mil", ids, precision="fp16", widen_weights=False, ane_numerics=True)
                except Exception as exc:
                    report.error = f"the ANE-numerics run failed: {type(exc).__name__}: {exc}"
                    return report
                report.comparisons.append(compare_logits(ane, hf, "transformers, ANE numerics", thresholds, resolution))
    return report
