"""Context buckets: prefill and decode functions per cache length, the smallest holding the filled
positions runs, and the tokens across a bucket boundary are those of a one-bucket export."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

import llama_ane
from llama_ane.cli import main
from llama_ane.contract.plan import ExportOptions, ExportOptionsError, auto_buckets
from llama_ane.contract.specs import base_function, bucket_function, bucket_of
from conftest import NEAR_TIE



@pytest.mark.parametrize("context, prefill, multifunction, want", [
    (2048, 64, True, (512, 1024, 2048)),
    (1024, 64, True, (512, 1024)),
    (256, 64, True, (256,)),
    (4096, 1024, True, (1024, 2048, 4096)),
    (3000, 64, True, (512, 1024, 2048, 3000)),
    (2048, 64, False, (2048,)),
])
def test_auto_buckets(context, prefill, multifunction, want):
    assert auto_buckets(context, prefill, multifunction) == want


def test_options_take_auto_one_size_or_sizes():
    assert ExportOptions(context_length=2048).context_buckets == (2048,)  # the default keeps one function
    assert ExportOptions(context_length=2048, decode_function="decode").context_buckets == (512, 1024, 2048)
    assert ExportOptions(context_length=2048, context_buckets=2048).context_buckets == (2048,)
    assert ExportOptions(context_length=2048, context_buckets=(1024, 2048)).context_buckets == (1024, 2048)
    assert ExportOptions(context_length=2048, target="iOS17").context_buckets == (2048,)


@pytest.mark.parametrize("options, words", [
    ({"context_buckets": (1024, 512, 2048)}, "ascending"),
    ({"context_buckets": (512, 1024)}, "must be --context-length"),
    ({"context_buckets": (500, 2048)}, "multiple of 32"),
    ({"context_buckets": (32, 2048)}, "prefill window"),
    ({"context_buckets": (1024, 2048), "target": "iOS17"}, "--target iOS17"),
    ({"context_buckets": "some"}, "'auto' or sizes"),
])
def test_bad_buckets_are_refused_by_name(options, words):
    with pytest.raises(ExportOptionsError, match=words):
        ExportOptions(context_length=2048, **options).check()


def test_function_names():
    assert bucket_function("decode", 512, 2048) == "decode_512"
    assert bucket_function("decode", 2048, 2048) == "decode"
    assert base_function("prefill_512") == "prefill" and base_function("decode_branches") == "decode_branches"
    assert [bucket_of(f, 2048) for f in ("decode_512", "prefill_1024_l3", "decode_l3", "verify", "decode")] == \
        [512, 1024, 2048, 2048, 2048]


def test_cli_refuses_bad_sizes_before_reading_anything(tmp_path):
    r = CliRunner().invoke(main, ["export", str(tmp_path / "missing"), "-o", str(tmp_path / "out"),
                                  "--context-buckets", "512,big"])
    assert r.exit_code != 0 and "Error: --context-buckets" in r.output
    assert not (tmp_path / "out").exists()


def test_info_models_the_kv_read_of_the_bucket_that_runs(tmp_path):
    """A --context-length 2048 export with decode functions and default buckets reads at most 1/4 of the K/V at 100
    filled positions that it reads at 2000 (modelled from the config, no export)."""
    from llama_ane.testing import TINY_CONFIG

    config = tmp_path / "config.json"
    config.write_text(json.dumps(dict(TINY_CONFIG, vocab_size=320, max_position_embeddings=4096)))
    read = {}
    for filled in (100, 2000):
        r = CliRunner().invoke(main, ["info", "--config", str(config), "--context-length", "2048", "--json",
                                      "--filled", str(filled), "--decode-function", "decode"])
        assert r.exit_code == 0, r.output
        read[filled] = json.loads(r.output)["decode_step_bytes"]["kv_read_bytes"]
    assert 0 < read[100] <= read[2000] / 4


@pytest.fixture(scope="module")
def exports(tiny_checkpoint, tmp_path_factory):
    """{(kv_cache, buckets): export} of one tiny model at context 1024: auto buckets (512, 1024) and one."""
    from llama_ane.api import export_model

    ckpt = tiny_checkpoint(num_hidden_layers=3, head_dim=32, max_position_embeddings=2048)
    made = {}
    for kv, precision in (("inputs", "fp32"), ("inputs", "fp16"), ("state", "fp16")):
        for buckets in ("auto", 1024):
            made[kv, precision, buckets] = export_model(
                ckpt, tmp_path_factory.mktemp("buckets") / f"{kv}-{precision}-{buckets}", context_length=1024,
                prefill_length=64, branch_width=0, verify_window=0, precision=precision, kv_cache=kv,
                context_buckets=buckets, fold_lm_head="no" if kv == "inputs" else "auto",  # a head apart, and folded
                decode_function="decode", progress=False, verify=False)
    return made


def _greedy(out, backend, prompt, **options):
    model = llama_ane.load(out, backend=backend, **options)
    try:
        model.manifest["tokenizer"]["eos_token_ids"] = []  # exactly 32 tokens
        return model.generate(prompt, max_new_tokens=32).token_ids
    finally:
        model.close()


PROMPT = [int(t) for t in np.random.default_rng(0).integers(5, 300, 500)]  # 500 tokens, then 32 past 512


@pytest.mark.export
def test_manifest_and_functions(exports):
    m = json.loads((exports["inputs", "fp32", "auto"] / "manifest.json").read_text())
    assert m["context_buckets"] == [512, 1024]
    assert set(m["models"]["chunk_0"]["functions"]) == {"prefill_512", "decode_512", "prefill", "decode"}
    assert set(m["models"]["lm_head"]["functions"]) == {"prefill", "decode"}  # the same in every bucket
    assert m["models"]["chunk_0"]["functions"]["decode_512"]["inputs"][4]["shape"][3] == 512
    assert m["chunks"][0]["cache_update"]["decode_512"] == "decode_512_l3"
    single = json.loads((exports["inputs", "fp32", 1024] / "manifest.json").read_text())
    assert single["context_buckets"] == [1024] and set(single["models"]["chunk_0"]["functions"]) == {"prefill",
                                                                                                      "decode"}


@pytest.mark.export
@pytest.mark.parametrize("backend", ["torch", "mil"])
def test_tokens_across_the_boundary_equal_one_buckets_fp32(exports, backend):
    got = _greedy(exports["inputs", "fp32", "auto"], backend, PROMPT, precision="fp32")
    want = _greedy(exports["inputs", "fp32", 1024], backend, PROMPT, precision="fp32")
    assert got == want


@pytest.mark.export
@pytest.mark.parametrize("kv", ["inputs", "state"])
def test_tokens_across_the_boundary_fp16_up_to_near_ties(exports, kv):
    """The mil backend's fp16 programs: identical tokens, except where the fp32 reference's top-2
    margin at the first difference is a near-tie (then the rest may differ)."""
    got = _greedy(exports[kv, "fp16", "auto"], "mil", PROMPT)
    want = _greedy(exports[kv, "fp16", 1024], "mil", PROMPT)
    if got != want:
        first = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
        exact = llama_ane.load(exports["inputs", "fp32", 1024], backend="torch", precision="fp32")
        logits = exact.score(PROMPT + want[:first])[-1]
        exact.close()
        top2 = np.sort(logits)[-2:]
        assert top2[1] - top2[0] < NEAR_TIE, f"tokens part at {first} with a clear fp32 margin"


@pytest.mark.export
def test_inspect_strict_and_the_gate_run_every_bucket(exports):
    out = exports["state", "fp16", "auto"]
    r = CliRunner().invoke(main, ["inspect", str(out), "--strict"])
    assert r.exit_code == 0 and "no ANE rule violations" in r.output, r.output
    assert "decode_512" in r.output
    model = llama_ane.load(out, backend="mil")
    calls = []
    predict = model.backend.predict
    model.backend.predict = lambda m, fn, inputs: calls.append(fn) or predict(m, fn, inputs)
    try:
        model.pipeline.score_streamed(PROMPT[:300], every_bucket=True)
    finally:
        model.close()
    assert {"prefill_512", "prefill"} <= set(calls)


@pytest.mark.export
def test_a_step_reads_only_its_bucket(exports):
    """Below 512 positions the chunks are given 512 cache positions, past it 1024."""
    model = llama_ane.load(exports["inputs", "fp16", "auto"], backend="mil")
    seen = []
    predict = model.backend.predict

    def spy(m, fn, inputs):
        if m == "chunk_0":
            seen.append((fn, inputs["k_cache"].shape[-1]))
        return predict(m, fn, inputs)
    model.backend.predict = spy
    try:
        model.manifest["tokenizer"]["eos_token_ids"] = []
        model.generate(PROMPT, max_new_tokens=16)
    finally:
        model.close()
    assert ("prefill_512", 512) in seen and ("decode_512", 512) in seen and ("decode", 1024) in seen
    assert all(width == (512 if fn.endswith("_512") else 1024) for fn, width in seen)
