"""Mistral: the Llama block without attention biases; its sliding_window applies to every layer
(layer_types is not read). llama.cpp writes its dense models as 'llama'."""

from __future__ import annotations

from .base import Family

FAMILY = Family("mistral", "Mistral", window_layer_types=False)
