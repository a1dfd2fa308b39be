"""The quantization quality measurements refuse, by name, the families their measuring model does
not cover whole, instead of failing inside transformers or measuring another network."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from llama_ane.api import auto_recipe, check_quality
from llama_ane.families import FAMILIES
from llama_ane.quantize import QuantizeOptions
from llama_ane.quantize.schemes import QuantizeError


UNMEASURED_FAMILIES = [t for t, f in FAMILIES.items() if not f.quality_model]


def test_the_unmeasured_families_are_phi3_the_granites_and_olmo_hybrid():
    assert sorted(UNMEASURED_FAMILIES) == ["granite", "granite_swa", "olmo_hybrid", "phi3"]


@pytest.mark.parametrize("family", UNMEASURED_FAMILIES)
def test_auto_refuses_and_the_check_says_it_did_not_measure(family):
    ckpt = SimpleNamespace(config=SimpleNamespace(model_type=family, num_hidden_layers=2, family=FAMILIES[family]))
    with pytest.raises(QuantizeError, match=f"cannot measure a {family} checkpoint"):
        auto_recipe(ckpt, 5.0, print)
    said = []
    assert math.isnan(check_quality(ckpt, QuantizeOptions.from_cli("lut4"), "iOS18", said.append))
    assert said == [f"quality: not measured for {family} checkpoints; check it with llama-ane eval"]
