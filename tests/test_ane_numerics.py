"""What the Neural Engine is reported to compute wrongly: the forms the exports write instead (the same
maths in fp32), the mil executor's ANE-numerics mode that applies the deviations, the inspect rule,
and `verify --ane-numerics` on exports of three families."""

from __future__ import annotations

import numpy as np
import pytest
import torch

ct = pytest.importorskip("coremltools")
from coremltools.converters.mil import Builder as mb  # noqa: E402

from llama_ane.mil import PackageExecutor  # noqa: E402
from llama_ane.mil.numerics import FP16_TINY, SOFTPLUS_COLLAPSE  # noqa: E402
from llama_ane.model.layers import Graph, silu_mil, softplus_mil  # noqa: E402
from conftest import convert_to  # noqa: E402

X = np.concatenate([np.linspace(-20, 20, 401), np.linspace(-0.05, 0.05, 101)]).astype(np.float32).reshape(1, -1)


def package(body, path, dtype):
    """One function y = body(g, x) over X's shape, saved with no graph pass (as the exporter saves)."""
    g = Graph(dtype, weights=lambda name: None)

    @mb.program(input_specs=[mb.TensorSpec(shape=X.shape, dtype=ct.converters.mil.mil.types.fp16
                                           if dtype == np.float16 else ct.converters.mil.mil.types.fp32)],
                opset_version=ct.target.iOS18)
    def prog(x):
        return body(g, x)

    return convert_to(prog, path, pass_pipeline=ct.PassPipeline.EMPTY,
                      compute_precision=ct.precision.FLOAT16 if dtype == np.float16 else ct.precision.FLOAT32)


def run(path, x, **numerics):
    ex = PackageExecutor(path, **numerics)
    return next(iter(ex.run("main", {"x": x}).values())).astype(np.float32)


FORMS = {"silu": (lambda g, x: mb.silu(x=x), silu_mil, torch.nn.functional.silu),
         "softplus": (lambda g, x: mb.softplus(x=x), softplus_mil, torch.nn.functional.softplus)}


@pytest.mark.parametrize("name", list(FORMS))
def test_the_written_forms_are_the_same_maths_in_fp32(name, tmp_path):
    _, form, reference = FORMS[name]
    got = run(package(form, tmp_path / "form.mlpackage", np.float32), X, precision="fp32")
    want = reference(torch.from_numpy(X)).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_the_ane_mode_breaks_the_ops_and_not_the_forms(tmp_path):
    """Under the ANE-numerics mode the softplus op collapses to 0 above 10.4 and silu is 1e-3 off near
    0; the forms the exports write stay within fp16 rounding of the exact values there. (In fp16 the
    silu form gives 0 below about -9, where silu is smaller than 1.2e-3.)"""
    x = X.astype(np.float16)
    exact = {name: reference(torch.from_numpy(x.astype(np.float32))).numpy() for name, (_, _, reference) in FORMS.items()}
    # the forms' fp16 tails: silu below -9; softplus where exp(-|x|) is an fp16 subnormal, which the mode flushes
    floor = {"silu": 1.2e-3, "softplus": 6.2e-5}
    near = np.abs(X) <= 0.05
    for name, (op, form, _) in FORMS.items():
        op_package = package(op, tmp_path / f"{name}_op.mlpackage", np.float16)
        old, plain = run(op_package, x, ane_numerics=True), run(op_package, x)
        new = run(package(form, tmp_path / f"{name}_form.mlpackage", np.float16), x, ane_numerics=True)
        close = lambda got, at=floor[name]: np.abs(got - exact[name]) <= 2e-3 * np.abs(exact[name]) + at  # noqa: E731
        assert close(plain).all() and close(new).all(), name  # the op is fine without the mode, the form with it
        assert close(new, 1e-5)[near].all(), name  # small activations keep their value
        assert not (close(old).all() and close(old, 1e-5)[near].all()), name
    softplus_op = run(tmp_path / "softplus_op.mlpackage", x, ane_numerics=True)
    assert np.all(softplus_op[X > SOFTPLUS_COLLAPSE] == 0) and np.all(softplus_op[(X > -5) & (X < SOFTPLUS_COLLAPSE - 0.1)] > 0)
    silu_op = run(tmp_path / "silu_op.mlpackage", x, ane_numerics=True)
    assert (np.abs(silu_op - exact["silu"])[near] > 9e-4).all()  # +1e-3 on small activations


def test_the_ane_mode_flushes_subnormal_results(tmp_path):
    def tiny(g, x):
        return mb.mul(x=x, y=g.scalar(1e-4))

    path = package(tiny, tmp_path / "tiny.mlpackage", np.float16)
    x = np.full(X.shape, 0.25, np.float16)  # 2.5e-5: an fp16 subnormal
    assert np.all(run(path, x) > 0) and np.all(run(path, x) < FP16_TINY)
    assert np.all(run(path, x, ane_numerics=True) == 0)
    with pytest.raises(ValueError, match="fp16"):
        PackageExecutor(path, precision="fp32", ane_numerics=True)


def test_inspect_names_the_ops_the_ane_gets_wrong(tmp_path):
    from llama_ane.export.inspect import inspect_package

    def wrong(g, x):
        return mb.add(x=mb.add(x=mb.silu(x=x), y=mb.softplus(x=x)),
                      y=mb.cast(x=mb.reduce_argmax(x=x, axis=1, keep_dims=True), dtype="fp16"))

    _, violations = inspect_package(package(wrong, tmp_path / "wrong.mlpackage", np.float16))
    found = {v.message.split("'")[1] for v in violations if v.rule == "ane-numerics"}
    assert found == {"silu", "softplus", "reduce_argmax"}
    _, clean = inspect_package(package(lambda g, x: softplus_mil(g, silu_mil(g, x)), tmp_path / "ok.mlpackage",
                                       np.float16))
    assert not [v for v in clean if v.rule == "ane-numerics"]


CASES = {
    "llama": dict(num_hidden_layers=3, head_dim=32),
    "gemma3": dict(model_type="gemma3_text", hidden_activation="gelu_pytorch_tanh", head_dim=32,
                   query_pre_attn_scalar=24, rope_local_base_freq=10_000.0, sliding_window=40, num_hidden_layers=3,
                   layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    "qwen35": dict(model_type="qwen3_5_text", head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                   linear_key_head_dim=16, linear_value_head_dim=32, num_hidden_layers=4,
                   layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"]),
}


@pytest.mark.export
@pytest.mark.parametrize("name", list(CASES))
def test_verify_with_the_ane_numerics(name, tmp_path):
    """The gate reports both modes, and an fp16 export of each family passes both."""
    from click.testing import CliRunner

    from llama_ane.api import export_model
    from llama_ane.commands.verify import command as verify
    from llama_ane.testing import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(tmp_path / "ckpt", **CASES[name])
    out = export_model(ckpt, tmp_path / "out", context_length=256, prefill_length=32, branch_width=0,
                       progress=False, verify=False)
    result = CliRunner().invoke(verify, [str(out), "--ane-numerics", "--quiet"])
    print(result.output)
    assert result.exit_code == 0, result.output
    rows = [line.split() for line in result.output.splitlines() if line.startswith("  transformers")]
    assert len(rows) == 2 and rows[0][0] == "transformers" and rows[0][-1] == "ok"
    assert rows[1][:3] == ["transformers,", "ANE", "numerics"] and rows[1][-1] == "ok"
    refused = CliRunner().invoke(verify, [str(out), "--ane-numerics", "--no-transformers", "--quiet"])
    assert refused.exit_code == 1 and "--ane-numerics" in refused.output
