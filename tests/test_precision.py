"""One table of the export precisions: every name of a precision finds it, and its sizes agree with
numpy's and torch's; the network imports without coremltools."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from llama_ane.precision import PRECISIONS, mil_type, precision_of


@pytest.mark.parametrize("name", sorted(PRECISIONS))
def test_every_name_of_a_precision_finds_it(name):
    p = PRECISIONS[name]
    for alias in (p.name, p.dtype, p.numpy, p.numpy.type, p.torch):
        assert precision_of(alias) is p, alias
    assert p.numpy.itemsize == torch.zeros(1, dtype=p.torch).element_size() == p.bytes


def test_mil_types_are_the_named_ones():
    from coremltools.converters.mil.mil import types

    assert mil_type("float16") is types.fp16 and mil_type("float32") is types.fp32
    assert mil_type("int32") is types.int32


@pytest.mark.parametrize("dtype", ["int8", np.float64, torch.bfloat16])
def test_other_dtypes_are_refused(dtype):
    with pytest.raises(ValueError, match="no export precision"):
        precision_of(dtype)


@pytest.mark.export
def test_the_network_imports_without_coremltools():
    """The torch-only runtime imports the model kinds; their MIL builders load coremltools on first use."""
    code = ("import sys, llama_ane.model.chunk, llama_ane.model.embeddings, llama_ane.model.lm_head, "
            "llama_ane.model.cache_update, llama_ane.contract.specs; print('coremltools' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
