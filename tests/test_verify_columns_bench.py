"""benchmarks/verify_columns.py's options: the model shapes, the ways, and its memory check."""

from __future__ import annotations

import pytest

from conftest import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("verify_columns")


def test_it_times_the_chosen_ways_for_each_column_count(bench, capsys):
    assert bench.main(["--shapes", "tiny", "--columns", "1,3", "--repeats", "1", "--ways", "linear,native",
                       "--cache", "0"]) == 0
    lines = capsys.readouterr().out.splitlines()
    table = lines[lines.index(next(line for line in lines if line.lstrip().startswith("columns"))):]
    assert "linear ms" in table[0] and "onednn" not in table[0]
    assert [row.split()[0] for row in table[1:]] == ["1", "3"]
    assert float(table[1].split()[2]) == 1.0  # one column through the first way is the step


def test_it_times_the_attention_over_the_cache_both_ways(bench, capsys):
    from llama_ane.runtime.backends import native_attention

    assert bench.main(["--shapes", "tiny", "--columns", "1,5", "--repeats", "1", "--ways", "linear",
                       "--cache", "37"]) == 0
    lines = capsys.readouterr().out.splitlines()
    at = lines.index(next(line for line in lines if line.startswith("attention of 2 layers over 37 cached")))
    assert lines[at + 1].split() == ["tokens", "torch", "ms", "x", "step", "native", "ms", "x", "step"]
    rows = [line.split() for line in lines[at + 2:]]
    assert [row[0] for row in rows] == ["1", "5"] and float(rows[0][2]) == 1.0
    assert len(rows[0]) == (5 if native_attention.available() else 6)  # "(no native kernel)" is two words


def test_the_presets_have_the_real_shapes(bench):
    from llama_ane.config import LlamaConfig

    shapes = bench.projection_shapes(LlamaConfig.from_hf_dict(bench.preset_config("1b")))
    assert len(shapes) == 16 * 7 + 1 and shapes[-1] == (128256, 2048)  # 16 layers of 7, the tied head
    assert sum(o * i for o, i in shapes) == 16 * (2 * 2048 * 2048 + 2 * 512 * 2048 + 3 * 8192 * 2048) + 128256 * 2048


def test_it_refuses_ways_that_would_not_fit_in_memory(bench, monkeypatch):
    monkeypatch.setattr(bench, "available_bytes", lambda: 8 << 30)
    with pytest.raises(SystemExit, match=r"8b with linear, native needs about .* GiB .* 8\.0 GiB is available"):
        bench.main(["--shapes", "8b", "--ways", "linear,native"])


def test_unknown_ways_are_refused(bench):
    with pytest.raises(SystemExit, match="--ways takes"):
        bench.main(["--shapes", "tiny", "--ways", "linear,fast"])
