"""A short-convolution decoder layer of transformers (Lfm2DecoderLayer, Lfm3DecoderLayer) beside ours
(model.layers.short_conv.ConvLayer): our layout of its input, and its outputs and conv state over
one random sequence."""

from __future__ import annotations

import torch


def channels_first(x: torch.Tensor) -> torch.Tensor:
    """(1, S, C) -> (1, C, 1, S)"""
    return x.transpose(1, 2).unsqueeze(2)


def conv_pair(cfg, hf, module, tokens: int):
    """(hf, module, x, y, state): a random x (1, tokens, C), hf's output y on it from an empty cache,
    and the conv state hf's cache holds after it (1, C, K)."""
    from transformers import DynamicCache

    x = torch.randn(1, tokens, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    cache = DynamicCache(config=cfg)
    with torch.no_grad():
        y = hf(x, cache=cache)
    return hf, module, x, y, cache.get_conv_state(0, state_idx=0)


def random_layer(layer_class, cfg):
    """transformers' decoder layer 0 of `cfg`, its norms' weights about 1 and the rest about 0 (seeded)."""
    torch.manual_seed(0)
    module = layer_class(cfg, 0).eval()
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(1.0 if p.dim() == 1 else 0.0, 0.3)
    return module


def with_weights_of(module, hf, renamed: dict[str, str]):
    """`module` given every weight of transformers' layer `hf`, each name's prefix renamed by `renamed`
    (theirs -> ours) and reshaped to ours: strict, so no weight is left out on either side."""
    shapes = {name: t.shape for name, t in module.state_dict().items()}
    state = {}
    for name, t in hf.state_dict().items():
        theirs = next((p for p in renamed if name.startswith(p)), "")
        name = renamed.get(theirs, "") + name[len(theirs):]
        state[name] = t.reshape(shapes[name])
    module.load_state_dict(state)
    return module
