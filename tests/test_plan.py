"""The chunk plan: every layer in exactly one chunk, explicit sizes, the default from weight bytes."""

from __future__ import annotations

import pytest

from llama_ane.contract.sizing import layer_weight_bytes, plan_chunks
from llama_ane.model.lm_head import vocab_splits
from llama_ane.export import ane_rules
from llama_ane.limits import file_limit_bytes
from llama_ane.config import LlamaConfig

SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, head_dim=64)
LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, head_dim=128)
LLAMA2_13B = dict(vocab_size=32000, hidden_size=5120, intermediate_size=13824, num_hidden_layers=40,
                  num_attention_heads=40, num_key_value_heads=40, head_dim=128)
TINY = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=5,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16)


def cfg(**fields) -> LlamaConfig:
    return LlamaConfig(**fields)


def assert_partition(plan: list[list[int]], n: int) -> None:
    """Every layer in exactly one chunk, chunks contiguous and in order."""
    flat = [layer for chunk in plan for layer in chunk]
    assert flat == list(range(n))
    assert all(chunk for chunk in plan)


@pytest.mark.parametrize("n, k, want", [
    (5, 2, [[0, 1], [2, 3], [4]]),
    (5, 1, [[0], [1], [2], [3], [4]]),
    (5, 5, [[0, 1, 2, 3, 4]]),
    (5, 9, [[0, 1, 2, 3, 4]]),
    (6, 3, [[0, 1, 2], [3, 4, 5]]),
    (1, 4, [[0]]),
])
def test_explicit_layers_per_chunk(n, k, want):
    plan = plan_chunks(cfg(**dict(TINY, num_hidden_layers=n)), k)
    assert plan == want
    assert_partition(plan, n)


@pytest.mark.parametrize("bad", [0, -1])
def test_layers_per_chunk_below_one_is_refused(bad):
    with pytest.raises(ValueError, match="layers-per-chunk"):
        plan_chunks(cfg(**TINY), bad)


def test_layer_weight_bytes_counts_every_parameter_of_a_layer():
    from transformers import LlamaConfig as HFLlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    c = cfg(**dict(TINY, head_dim=24))
    layer = LlamaDecoderLayer(HFLlamaConfig(**c.to_hf_dict()), layer_idx=0)
    params = sum(p.numel() for p in layer.parameters())
    assert layer_weight_bytes(c, 2) == 2 * params
    assert layer_weight_bytes(c, 4) == 4 * params


@pytest.mark.parametrize("fields", [SMOLLM2_135M, LLAMA3_8B, LLAMA2_13B, TINY])
@pytest.mark.parametrize("target", ["iOS18", "macOS15"])
@pytest.mark.parametrize("bytes_per_weight", [2, 4])
def test_default_plan_respects_the_file_limit(fields, target, bytes_per_weight):
    c = cfg(**fields)
    plan = plan_chunks(c, None, target=target, bytes_per_weight=bytes_per_weight)
    assert_partition(plan, c.num_hidden_layers)
    per_layer = layer_weight_bytes(c, bytes_per_weight)
    limit = ane_rules.FILE_LIMIT_BYTES[ane_rules.platform_of(target)]  # the limit inspect enforces
    for chunk in plan:
        assert len(chunk) * per_layer <= limit or len(chunk) == 1
    # the fewest chunks the limit allows, spread evenly
    k = max(1, limit // per_layer)
    assert len(plan) == -(-c.num_hidden_layers // k)
    assert max(map(len, plan)) - min(map(len, plan)) <= 1


def test_plan_limit_is_the_one_inspect_enforces():
    for target in ("iOS16", "iOS18", "macOS13", "macOS15"):
        size = file_limit_bytes(target)
        assert ane_rules.check_file_size("x.mlpackage", size, target) == []
        assert [v.rule for v in ane_rules.check_file_size("x.mlpackage", size + 1, target)] == ["file-size"]
    assert file_limit_bytes("iOS18") == 1_000_000_000 and file_limit_bytes("macOS15") == 2_000_000_000


def test_default_llama_3b_chunks_pass_inspect():
    """A 3B iOS plan once chose 5-layer chunks of ~1.007 GB that `inspect --strict` then rejected."""
    c = cfg(vocab_size=128256, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
            num_attention_heads=24, num_key_value_heads=8, head_dim=128)
    plan = plan_chunks(c, None, target="iOS18")
    assert all(ane_rules.check_file_size("c", len(ch) * layer_weight_bytes(c), "iOS18") == [] for ch in plan)


def test_default_plan_of_known_models():
    assert plan_chunks(cfg(**SMOLLM2_135M)) == [list(range(30))]  # 30 x 7 MB fits one iOS file
    big = plan_chunks(cfg(**LLAMA3_8B), target="iOS18")
    assert len(big) == 16 and all(len(c) == 2 for c in big)  # 2 x 436 MB per 1 GB file


@pytest.mark.parametrize("vocab", [320, 16384, 16385, 32000, 32001, 49152, 128256, 151936])
def test_vocab_splits_never_exceed_16384(vocab):
    splits = vocab_splits(vocab)
    assert sum(splits) == vocab
    assert max(splits) <= 16384
    assert len(splits) == -(-vocab // 16384)
    assert max(splits) - min(splits) <= 128  # near-equal, cut at multiples of 64 rows
    assert all(n % 64 == 0 for n in splits[:-1])  # so a LUT of 16 or 64 output channels divides them
