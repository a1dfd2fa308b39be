"""Shared fixtures and the auto-skip of platform markers (macos, cuda)."""

from __future__ import annotations

import contextlib
import os
import platform
import subprocess
from pathlib import Path

import pytest

def _has_cuda() -> bool:
    try:
        import torch
        import triton  # noqa: F401
    except Exception:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    skip_macos = pytest.mark.skip(reason="needs macOS with Core ML")
    skip_cuda = pytest.mark.skip(reason="needs an NVIDIA GPU with triton")
    on_macos = platform.system() == "Darwin"
    has_cuda = _has_cuda() if any("cuda" in item.keywords for item in items) else False
    for item in items:
        if EXPORTING_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.export)
        if "macos" in item.keywords and not on_macos:
            item.add_marker(skip_macos)
        if "cuda" in item.keywords and not has_cuda:
            item.add_marker(skip_cuda)


# fixtures that export a model: a test using one is in the export tier whether it says so or not
EXPORTING_FIXTURES = {"tiny_export", "smollm2_export"}
UNIT_TIER_MARKS = "not slow and not export and not long"  # pyproject.toml's addopts: a plain `pytest`
TIERS = ("long", "slow", "export")  # a test is in the first of these it is marked with, else in the unit tier
_tier_seconds: dict[str, float] = {}


def _unit_tier(config) -> bool:
    return os.environ.get("LLAMA_ANE_UNIT_TIER") == "1" or config.getoption("markexpr") == UNIT_TIER_MARKS


def pytest_runtest_logreport(report):
    tier = next((t for t in TIERS if t in report.keywords), "unit")
    _tier_seconds[tier] = _tier_seconds.get(tier, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    """The time each tier's tests took (setup, call and teardown, summed over the workers)."""
    if _tier_seconds:
        terminalreporter.write_line("time by tier: " + ", ".join(
            f"{tier} {_tier_seconds[tier]:.0f} s" for tier in ("unit", *reversed(TIERS)) if tier in _tier_seconds))


def _signals_as_at_a_terminal() -> None:
    """Ctrl-C and SIGHUP back to their defaults where this run inherited them ignored (a background
    job of a script ignores SIGINT, `nohup` SIGHUP): the processes the tests start inherit an
    ignored signal, and the tests that stop an export or a reply with one would wait in vain."""
    import signal

    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if hasattr(signal, "SIGHUP") and signal.getsignal(signal.SIGHUP) is signal.SIG_IGN:
        signal.signal(signal.SIGHUP, signal.SIG_DFL)


def _one_thread_a_worker() -> None:
    """Under pytest-xdist there is a worker a core: each computes (and starts processes) with one
    thread, so the workers do not contend for the cores."""
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ.setdefault(name, "1")
    import torch

    torch.set_num_threads(1)


def _own_cache_folder() -> None:
    """The user cache folder (chat history, info's remembered hashes) in a temporary folder of this
    process, removed at its exit: tests never write into the real one."""
    import atexit
    import shutil
    import tempfile

    folder = tempfile.mkdtemp(prefix="llama-ane-test-cache-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    os.environ["XDG_CACHE_HOME"] = folder


def pytest_configure(config):
    """In the unit tier (`make test-quick`), exporting a model or starting a process fails at once,
    in a test or in any fixture it uses, naming the mark the test lacks: the tier stays quick
    because nothing slips into it."""
    _signals_as_at_a_terminal()
    _own_cache_folder()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        _one_thread_a_worker()
    if not _unit_tier(config):
        return

    def refuse(what):
        def stop(*args, **kwargs):
            pytest.fail(f"this test {what} in the unit tier: mark it @pytest.mark.export (or slow)", pytrace=False)
        return stop
    from llama_ane.export import convert

    convert.convert_all = refuse("exports a model")
    subprocess.Popen.__init__ = refuse("starts a subprocess")


def _digest(text: str) -> str:
    import hashlib

    return hashlib.sha256(text.encode()).hexdigest()[:12]


def shared(tmp_path_factory, name: str, build) -> Path:
    """The folder `name`, built once by `build(folder)` for the whole run: with pytest-xdist, the
    first worker to ask builds it under a lock in the run's common temporary folder and the others
    wait for it, so a session fixture's export is made once, not once a worker. Returns what
    `build` returned the first time (a path under that folder)."""
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # every worker's basetemp sits in the run's one folder
    folder, done = root / "shared" / name, root / "shared" / f"{name}.done"
    folder.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(folder) + ".lock"):
        if not done.is_file():
            made = build(folder)
            done.write_text(str(made))
    return Path(done.read_text())


def convert_to(source, path, **options):
    """`ct.convert` of `source` (a MIL program or a traced module) for iOS18, written straight into
    the .mlpackage `path` (package_dir): converted and then saved, coremltools would first write a
    temporary package into /tmp, left there whenever the model object outlives the test."""
    import coremltools as ct

    ct.convert(source, minimum_deployment_target=ct.target.iOS18, package_dir=str(path), **options)
    return path


# fp32 top-2 logit margin below which two fp16 programs may rightly pick different tokens: each of
# them stays within about 0.03 of the fp32 logits on the tiny models, so together they can swap a
# pair closer than twice that
NEAR_TIE = 0.06

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """Factory: tiny_checkpoint(**config_overrides) -> folder of a tiny random HF Llama checkpoint."""
    from llama_ane.testing import make_tiny_checkpoint

    made = {}

    def make(**overrides):
        key = repr(sorted(overrides.items()))
        if key not in made:
            made[key] = shared(tmp_path_factory, f"tiny-{_digest(key)}",
                               lambda folder: make_tiny_checkpoint(folder, **overrides))
        return made[key]
    return make


@pytest.fixture(scope="session")
def tiny_export(tiny_checkpoint, tmp_path_factory):
    """One fp16 export of a 5-layer GQA tiny model (2 layers per chunk, context 256, a verify window of
    16) with decode functions, context buckets and the cascade's function, shared by the session (the
    default, where the prefill window decodes, is held in test_prefill_decodes, test_serve and
    test_families).

    head_dim is 32 (explicit, > hidden/heads) so every cache dimension is ANE-aligned, as in real models.
    """
    from llama_ane.api import export_model

    ckpt = tiny_checkpoint(num_hidden_layers=5, head_dim=32)
    return shared(tmp_path_factory, "tiny-export", lambda folder: export_model(
        ckpt, folder, context_length=256, prefill_length=64, layers_per_chunk=2, verify_window=16,
        decode_function="decode", progress=False, verify=False))


@pytest.fixture(scope="session")
def smollm2_export(tmp_path_factory):
    """The default model (SmolLM2-135M-Instruct) exported once per session with default options."""
    from llama_ane.api import export_model

    return shared(tmp_path_factory, "smollm2-export",
                  lambda folder: export_model(None, folder, progress=False, verify=False))


@contextlib.contextmanager
def no_eos(model):
    """Decode exactly max_new_tokens (a random model may pick EOS at any step)."""
    saved = model.manifest["tokenizer"]["eos_token_ids"]
    model.manifest["tokenizer"]["eos_token_ids"] = []
    try:
        yield
    finally:
        model.manifest["tokenizer"]["eos_token_ids"] = saved
