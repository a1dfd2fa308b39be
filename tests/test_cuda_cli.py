"""`llama-ane gpu-generate` without a GPU: a clear error, not a traceback (runs in CI)."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_gpu_generate_without_gpu_says_so():
    from llama_ane.cli import main

    result = CliRunner().invoke(main, ["gpu-generate", "--max-new-tokens", "2"])
    assert result.exit_code != 0
    assert "needs an NVIDIA GPU" in result.output
    assert "Traceback" not in result.output


def test_cuda_package_imports_without_triton():
    import llama_ane.cuda as cuda

    assert callable(cuda.lse_base2_to_natural)
    assert "SharedPrefixBatch" in cuda.__all__
