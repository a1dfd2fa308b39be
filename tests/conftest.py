"""Shared fixtures and the auto-skip of platform markers (macos, cuda)."""

from __future__ import annotations

import platform

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
        if "macos" in item.keywords and not on_macos:
            item.add_marker(skip_macos)
        if "cuda" in item.keywords and not has_cuda:
            item.add_marker(skip_cuda)
