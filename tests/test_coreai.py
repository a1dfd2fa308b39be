"""`llama-ane export --target coreai`: Core AI assets from the export plan, run by coreai-core's
runtime (the coreai backend) and compared with the torch modules they are converted from."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("coreai_torch", reason='needs the coreai extra: pip install -e ".[coreai]" (Python >= 3.11)')

pytestmark = pytest.mark.export

PROMPT_IDS = [5, 17, 42, 99, 3, 250, 7, 64, 11, 128, 33, 200]


def export_coreai(ckpt: Path, out: Path, *options: str) -> subprocess.CompletedProcess:
    """One `llama-ane export --target coreai` command on a tiny checkpoint. The context holds the
    128 tokens the parity gate scores: over fewer, one near-tie of a random model's flat logits
    would weigh more than the gate's 1% allows."""
    return subprocess.run([sys.executable, "-m", "llama_ane", "export", str(ckpt), "-o", str(out), "--target", "coreai",
                           "--context-length", "128", "--prefill-length", "16", "--branches", "0", *options],
                          capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def coreai_exports(tiny_checkpoint, tmp_path_factory):
    """fp32 and fp16 Core AI exports of one tiny model with input caches (states, the default, are
    tested below), each made (and verified) by one command."""
    ckpt = tiny_checkpoint(num_hidden_layers=3, head_dim=32)
    folders = {}
    for precision in ("fp32", "fp16"):
        out = tmp_path_factory.mktemp("coreai") / precision
        done = export_coreai(ckpt, out, "--precision", precision, "--kv-cache", "inputs")
        assert done.returncode == 0, done.stderr[-3000:]
        assert "passed" in done.stdout + done.stderr  # the parity gate ran on the coreai backend
        folders[precision] = out
    return ckpt, folders


def test_export_writes_aimodel_assets_the_manifest_names(coreai_exports):
    _, folders = coreai_exports
    manifest = json.loads((folders["fp32"] / "manifest.json").read_text())
    assert manifest["deployment_target"] == "coreai"
    files = {f["file"] for m in manifest["models"].values() for f in m["functions"].values()}
    assert files and all(name.endswith(".aimodel") and (folders["fp32"] / name / "main.mlirb").is_file()
                         for name in files)
    assert not list(folders["fp32"].glob("*.mlpackage"))
    fns = manifest["models"]["embeddings"]["functions"]  # each function an entry point of its own name
    assert {f["function_name"] for f in fns.values()} == set(fns)


def _greedy(model, steps: int = 12) -> list[int]:
    return [int(t) for t in model.generate(PROMPT_IDS, max_new_tokens=steps, temperature=0.0).token_ids]


def test_coreai_backend_greedy_tokens_equal_torch_fp32(coreai_exports):
    from llama_ane.runtime.model import load

    _, folders = coreai_exports
    tokens = {}
    for backend in ("auto", "torch"):  # auto: a Core AI export runs on the coreai backend
        model = load(folders["fp32"], backend=backend, **({"checkpoint": coreai_exports[0]} if backend == "torch"
                                                          else {}))
        try:
            tokens[model.backend.name] = _greedy(model)
        finally:
            model.close()
    assert tokens["coreai"] == tokens["torch"]


def test_the_backend_stops_before_the_runtime_keeps_too_much(coreai_exports):
    """The runtime keeps every output buffer it returns (docs/coreai.md): the backend counts what the
    process received and, past its limit, refuses to run more with one line that says to restart."""
    from llama_ane.runtime.backends.coreai_backend import BackendError, received_bytes
    from llama_ane.runtime.model import load

    _, folders = coreai_exports
    before = received_bytes()
    model = load(folders["fp32"], backend="coreai", output_limit_bytes=before + 2_000_000)
    try:
        with pytest.raises(BackendError, match="keeps every output it returns.*restart the process"):
            model.generate(PROMPT_IDS, max_new_tokens=400, temperature=0.0)
        assert received_bytes() > before + 2_000_000
    finally:
        model.close()


def test_coreai_fp16_top1_against_torch_fp16(coreai_exports):
    from llama_ane.runtime.model import load
    from llama_ane.verify import top1_agreement

    ckpt, folders = coreai_exports
    ids = list(range(3, 3 + 48))
    logits = {}
    for backend, options in (("coreai", {}), ("torch", {"checkpoint": ckpt, "precision": "fp16"})):
        model = load(folders["fp16"], backend=backend, **options)
        try:
            logits[backend] = np.asarray(model.score(ids), dtype=np.float32)
        finally:
            model.close()
    assert logits["coreai"].shape == logits["torch"].shape
    assert top1_agreement(logits["coreai"], logits["torch"], np.float16) >= 0.98


def test_structure_of_saved_assets(coreai_exports):
    from llama_ane.export.coreai import structure
    from llama_ane.limits import MAX_DIM

    _, folders = coreai_exports
    manifest = json.loads((folders["fp16"] / "manifest.json").read_text())
    for entry in manifest["models"].values():
        for f in entry["functions"].values():
            found, violations = structure(folders["fp16"] / f["file"], "fp16")
            assert violations == []
            assert 0 < found["largest_dim"][0] <= MAX_DIM
            assert f["function_name"] in found["functions"]
    # the same fp16 rule fails an fp32 asset: the check reads the program, not the manifest
    chunk = next(f["file"] for f in manifest["models"]["chunk_0"]["functions"].values())
    _, violations = structure(folders["fp32"] / chunk, "fp16")
    assert any(rule == "fp32-io" and "is float32, not float16" in message for rule, _, message in violations)


def test_other_compression_is_refused(tiny_checkpoint, tmp_path):
    done = export_coreai(tiny_checkpoint(), tmp_path / "out", "--quantize", "int8")
    assert done.returncode != 0
    assert done.stderr.strip().splitlines()[-1].startswith("Error: --target coreai compresses weights with coreai-opt")
    assert not (tmp_path / "out").exists()


def sixteen_levels(ckpt: Path, out: Path) -> Path:
    """A copy of checkpoint `ckpt` whose every matrix holds 16 values (its quantiles): a model a
    4-bit palette can hold. A random model's logits are so flat that lut4's rounding leaves its
    top-1 agreement near the gate's 0.3 (0.289 or just over it, by the k-means' library versions)."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(ckpt, out)
    weights = load_file(str(out / "model.safetensors"))
    for name, w in weights.items():
        if w.ndim == 2:
            levels = torch.quantile(w.float().flatten()[:100_000], torch.linspace(0.02, 0.98, 16))
            weights[name] = levels[(w.float()[..., None] - levels).abs().argmin(-1)].to(w.dtype)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def test_lut4_export_runs_and_passes_its_gate(tiny_checkpoint, tmp_path):
    out = tmp_path / "lut4"
    ckpt = sixteen_levels(tiny_checkpoint(num_hidden_layers=3, head_dim=32), tmp_path / "sixteen_levels")
    done = export_coreai(ckpt, out, "--quantize", "lut4")
    assert done.returncode == 0, done.stderr[-3000:]
    manifest = json.loads((out / "manifest.json").read_text())
    assert {d["scheme"] for d in manifest["quantization"].values() if "scheme" in d} == {"lut4"}
    from llama_ane.export.coreai import structure

    chunk = next(f["file"] for f in manifest["models"]["chunk_0"]["functions"].values())
    found, _ = structure(out / chunk, "fp16")
    assert "coreai.lut_to_dense" in found["operations"]  # palettized weights in the program itself


@pytest.mark.slow
def test_smollm2_coreai_export_passes_its_parity_gate(tmp_path):
    """The default model (SmolLM2-135M-Instruct) to Core AI in one command, whose parity gate runs
    the assets on the coreai backend against the torch modules and transformers. In fp32: Core AI's
    runtime on Linux computes fp16 assets far slower than fp32 ones (the gate's 128 tokens of an fp16
    SmolLM2 take over a quarter of an hour here); fp16 assets pass their gate on the tiny exports above."""
    out = tmp_path / "smollm2"
    done = subprocess.run([sys.executable, "-m", "llama_ane", "export", "-o", str(out), "--target", "coreai",
                           "--precision", "fp32", "--context-length", "256", "--prefill-length", "64",
                           "--branches", "0"], capture_output=True, text=True, timeout=3600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = done.stdout + done.stderr
    assert "backend coreai" in report and "passed" in report
    assets = [p for p in out.iterdir() if p.is_dir()]
    assert assets and all(p.suffix == ".aimodel" for p in assets)


# --- caches in Core AI states (--kv-cache state) -----------------------------------------------------

BUCKETS = (64, 128)


@pytest.fixture(scope="module")
def state_export(tiny_checkpoint, tmp_path_factory):
    """An fp32 export with its caches in Core AI states, two context buckets and a cascade of two
    branches, made (and verified) by one command."""
    ckpt = tiny_checkpoint(num_hidden_layers=3, head_dim=32)
    out = tmp_path_factory.mktemp("coreai_state") / "state"
    done = export_coreai(ckpt, out, "--precision", "fp32", "--kv-cache", "state", "--branches", "2",
                         "--suffix-length", "32", "--context-buckets", ",".join(map(str, BUCKETS)))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "KV caches in Core AI states" in done.stdout + done.stderr
    assert "backend coreai" in done.stdout + done.stderr and "passed" in done.stdout + done.stderr
    return ckpt, out


def test_state_export_keeps_the_caches_in_the_assets_states(state_export):
    from coreai.authoring.asset import AIModelAsset

    from llama_ane.export.coreai import function_io, structure

    _, out = state_export
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["cache"]["kind"] == "state"
    # the windows write their own K/V: the cache-update model keeps only the cascade's suffix updates
    assert all(fn.startswith("decode_branches") for fn in manifest["models"]["cache_update"]["functions"])
    chunk = manifest["models"]["chunk_0"]["functions"]
    asset = AIModelAsset.load(out / chunk["decode"]["file"])
    for fn, entry in chunk.items():
        io = function_io(asset, entry["function_name"])
        assert {n: (d, s) for n, (d, s) in io["states"].items()} == {
            t["name"]: (t["dtype"], t["shape"]) for t in entry["states"]}
        # one state of the whole context in every bucket's function
        assert sorted(io["states"]) == ["k_cache", "v_cache"]
        assert all(shape[3] == manifest["context_length"] for _, shape in io["states"].values())
        assert not {"k_cache", "v_cache"} & set(io["inputs"])
        assert ("k_new" in io["outputs"]) == (fn == "decode_branches")  # the suffix caches take the cascade's
    found, violations = structure(out / chunk["decode"]["file"])
    assert violations == []
    assert found["operations"]["coreai.write_handle"] == 2 * len(chunk)  # each function writes both states
    # `inspect` lists them as it lists Core ML's: last among the inputs, marked as states
    from llama_ane.export.inspect import inspect_path

    report = inspect_path(out)
    assert report.violations == []
    listed = {f.function: f for p in report.packages for f in p.functions if f.model == "chunk_0"}
    assert sorted(listed) == sorted(e["function_name"] for e in chunk.values())
    for f in listed.values():
        assert [d.name for d in f.inputs if d.is_state] == [d.name for d in f.inputs[-2:]]
        assert sorted(d.name for d in f.inputs if d.is_state) == ["k_cache", "v_cache"]


def test_state_export_greedy_tokens_equal_torch_across_buckets(state_export):
    """A prompt of several windows, then decoding past the first bucket: every function reads and
    writes the same states, which persist between calls."""
    ckpt, out = state_export
    prompt = list(range(3, 3 + 50))
    tokens, caches = _greedy_on_both(ckpt, out, prompt, 24)
    assert tokens["coreai"] == tokens["torch"]
    assert len(prompt) + 24 > BUCKETS[0]
    held = caches["torch"].position
    for mine, want in zip(caches["coreai"].caches, caches["torch"].caches):
        for key in ("k", "v"):
            np.testing.assert_allclose(mine[key][..., :held], want[key][..., :held], atol=1e-4)


def _greedy_from(model, prompt: list[int], steps: int, cache) -> list[int]:
    return [int(t) for t in model.generate(prompt, max_new_tokens=steps, temperature=0.0, cache=cache).token_ids]


def _greedy_on_both(ckpt: Path, out: Path, prompt: list[int], steps: int) -> tuple[dict, dict]:
    """{backend: greedy tokens} and {backend: the cache they leave} on the coreai backend and on
    torch (fp32 modules of `ckpt`), each cache's held states copied back into its arrays."""
    from llama_ane.runtime.model import load

    tokens, caches = {}, {}
    for backend in ("coreai", "torch"):
        model = load(out, backend=backend, **({"checkpoint": ckpt, "precision": "fp32"} if backend == "torch" else {}))
        try:
            cache = model.make_cache()
            tokens[backend] = _greedy_from(model, prompt, steps, cache)
            model.pipeline.wait()
            model.backend.sync_states()  # the runtime's states copied back into the cache arrays
            caches[backend] = cache
        finally:
            model.close()
    return tokens, caches


def test_state_export_cascade_equals_decoding_alone(state_export):
    assert_cascade_equals_decoding_alone(state_export[1])


def assert_cascade_equals_decoding_alone(out: Path) -> None:
    """On the coreai backend, two branches over one prefix decode what each decodes alone."""
    from llama_ane.runtime.model import load

    prefix, conts = list(range(5, 5 + 20)), [[4, 6, 7], [90, 91, 92, 93, 94]]
    model = load(out, backend="coreai")
    try:
        branches = model.generate_branches(prefix, conts, max_new_tokens=6).branches
        for r, cont in zip(branches, conts):
            assert r.token_ids == model.generate(prefix + cont, max_new_tokens=6, temperature=0.0).token_ids
    finally:
        model.close()


def test_buckets_are_entry_points_per_context_and_query_length(state_export):
    """What coreai-core reads back from each asset: exactly the functions the manifest names in it,
    a prefill (the prefill window) and a decode (one token) per context bucket, whose masks cover
    that bucket's positions."""
    from coreai.authoring.asset import AIModelAsset

    from llama_ane.export.coreai import function_io
    from llama_ane.model.functions import bucket_function

    _, out = state_export
    manifest = json.loads((out / "manifest.json").read_text())
    context, window = manifest["context_length"], manifest["prefill_length"]
    assert manifest["context_buckets"] == list(BUCKETS)
    files: dict[str, set[str]] = {}
    for entry in manifest["models"].values():
        for f in entry["functions"].values():
            files.setdefault(f["file"], set()).add(f["function_name"])
    for file, names in files.items():
        assert set(AIModelAsset.load(out / file).summary().function_names) == names, file
    for model in ("embeddings", "chunk_0"):
        entry = manifest["models"][model]["functions"]
        asset = AIModelAsset.load(out / entry["decode"]["file"])
        for bucket in BUCKETS:
            for fn, s in (("prefill", window), ("decode", 1)):
                io = function_io(asset, entry[bucket_function(fn, bucket, context)]["function_name"])
                mask = io["outputs" if model == "embeddings" else "inputs"]["mask"][1]
                assert mask == [1, 1, s, bucket + s], (model, fn, bucket)


@pytest.mark.parametrize("family", ["lfm2", "gemma3"])
def test_state_export_of_conv_state_and_ring(family, tmp_path):
    """LFM2's conv state and Gemma 3's sliding ring (64 slots, wrapped by the gate's 128 tokens) as
    states: the export passes its parity gate on the coreai backend and decodes torch's tokens."""
    from support.families import CASES, LFM2_CHECKPOINT

    from llama_ane.runtime.model import load
    from llama_ane.testing import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(tmp_path / "ckpt", **(LFM2_CHECKPOINT if family == "lfm2" else CASES["gemma3_tied_gqa"]))
    out = tmp_path / "out"
    done = export_coreai(ckpt, out, "--precision", "fp32", "--kv-cache", "state")
    assert done.returncode == 0, done.stderr[-3000:]
    manifest = json.loads((out / "manifest.json").read_text())
    states = {t["name"] for t in manifest["models"]["chunk_0"]["functions"]["decode"]["states"]}
    assert states >= ({"conv_state"} if family == "lfm2" else {"k_ring", "v_ring"})
    tokens = {}
    for backend in ("coreai", "torch"):
        model = load(out, backend=backend, **({"checkpoint": ckpt, "precision": "fp32"} if backend == "torch" else {}))
        try:
            tokens[backend] = _greedy_from(model, list(range(3, 3 + 70)), 12, None)
        finally:
            model.close()
    assert tokens["coreai"] == tokens["torch"]


@pytest.mark.parametrize("kv_cache", ["inputs", "state"])
def test_qwen35_export_passes_its_gate_and_decodes_as_torch(kv_cache, tmp_path):
    """Qwen3.5's linear-attention layers with their conv and recurrent states (delta_state) as
    inputs the host writes back from conv_new and delta_new, or as Core AI states the window
    functions write: the export passes its parity gate on the coreai backend, decodes torch's
    tokens after a padded prompt window, holds torch's states after it, and its cascade equals
    decoding each branch alone (the cascade's function takes only the K/V states)."""
    from support.families import CASES

    from llama_ane.testing import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(tmp_path / "ckpt", **CASES["qwen35_tied_gqa"])
    out = tmp_path / "out"
    done = export_coreai(ckpt, out, "--precision", "fp32", "--kv-cache", kv_cache, "--branches", "2",
                         "--suffix-length", "32")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "backend coreai" in done.stdout + done.stderr and "passed" in done.stdout + done.stderr
    chunk = json.loads((out / "manifest.json").read_text())["models"]["chunk_0"]["functions"]
    held = {t["name"] for t in chunk["decode"].get("states", [])}
    passed = {t["name"] for t in chunk["decode"]["inputs"]}
    assert ({"conv_state", "delta_state"} <= held) == (kv_cache == "state")
    assert ({"conv_state", "delta_state"} <= passed) == (kv_cache == "inputs")
    assert {t["name"] for t in chunk["decode_branches"].get("states", [])} == (
        {"k_cache", "v_cache"} if kv_cache == "state" else set())
    tokens, caches = _greedy_on_both(ckpt, out, list(range(3, 3 + 70)), 12)  # the fifth window: 6 real tokens of 16
    assert tokens["coreai"] == tokens["torch"]
    for mine, want in zip(caches["coreai"].caches, caches["torch"].caches, strict=True):
        for key in ("conv", "delta"):
            assert np.abs(want[key]).max() > 0.01  # the states the prompt left, not the zeros they start at
            np.testing.assert_allclose(mine[key], want[key], atol=1e-4)
    assert_cascade_equals_decoding_alone(out)
