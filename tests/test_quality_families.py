"""The quantization quality measurements refuse, by name, the families their measuring model does
not cover whole, instead of failing inside transformers or measuring another network."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from llama_ane.export.quality import auto_recipe, check_quality
from llama_ane.families import FAMILIES
from llama_ane.quantize import QuantizeOptions
from llama_ane.quantize.schemes import QuantizeError

from support.families import CASES, LFM2_CHECKPOINT


UNMEASURED_FAMILIES = [t for t, f in FAMILIES.items() if not f.quality_model]


def test_the_unmeasured_families_are_phi3_the_granites_lfm_olmo_hybrid_and_falcon_h1():
    assert sorted(UNMEASURED_FAMILIES) == ["falcon_h1", "granite", "granite_swa", "lfm2", "lfm3", "olmo_hybrid", "phi3"]


@pytest.mark.parametrize("family", UNMEASURED_FAMILIES)
def test_auto_refuses_and_the_check_says_it_did_not_measure(family):
    ckpt = SimpleNamespace(config=SimpleNamespace(model_type=family, num_hidden_layers=2, family=FAMILIES[family]))
    with pytest.raises(QuantizeError, match=f"cannot measure a {family} checkpoint"):
        auto_recipe(ckpt, 5.0, print)
    said = []
    assert math.isnan(check_quality(ckpt, QuantizeOptions.from_cli("lut4"), "iOS18", said.append))
    assert said == [f"quality: not measured for {family} checkpoints; check it with llama-ane eval"]


# checkpoints with conv layers beside attention, or a Mamba-2 mixer's convolution (support/families.py)
CONV_CASES = {"lfm2": LFM2_CHECKPOINT, "lfm3": CASES["lfm3_tied_gqa"], "falcon_h1": CASES["falcon_h1_tied_gqa"]}


@pytest.mark.parametrize("name", list(CONV_CASES))
def test_calibration_weighs_every_compressed_weight_of_conv_layers(name, tmp_path):
    """The calibration (which fixed LUT and int4 schemes are weighted by) runs through conv layers and
    gives an importance for every weight the export compresses, in conv and attention layers alike."""
    from llama_ane.api import calibrate
    from llama_ane.checkpoint.loader import load_checkpoint
    from llama_ane.checkpoint.mapping import layer_tensors
    from llama_ane.contract.sizing import weight_part
    from llama_ane.testing import make_tiny_checkpoint

    ckpt = load_checkpoint(make_tiny_checkpoint(tmp_path / name, **CONV_CASES[name]))
    cfg = ckpt.config
    found = calibrate(ckpt, lambda _: None)
    want = {key for n in range(cfg.num_hidden_layers) for ours in layer_tensors(cfg, n)
            if weight_part(key := f"layers.{n}.{ours}") is not None}
    assert {f"layers.{n}.conv.in_proj.weight" for n in cfg.conv_layers} <= want
    assert {f"layers.{n}.mamba.{p}_proj.weight" for n in cfg.mamba_layers for p in ("in", "out")} <= want
    assert want <= set(found)
    assert all(found[k].shape == (cfg.hidden_size,) for k in want
               if "down_proj" not in k and "o_proj" not in k and "out_proj" not in k or "conv.out_proj" in k)
