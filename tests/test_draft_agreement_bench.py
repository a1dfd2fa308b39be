"""benchmarks/draft_agreement.py: its counts on hand-made answers, and its replay's alignment."""

from __future__ import annotations

import json

import numpy as np
import pytest

import llama_ane
from conftest import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("draft_agreement")


def test_lookup_guesses_what_followed_the_roots_latest_occurrence(bench):
    # Steps (root -> next): 7 -> 1, a miss (no earlier 7); 1 -> 2, a hit (1 2 in the prompt);
    # 2 -> 3, a miss (the only earlier 2 was followed by 5).
    assert bench.lookup_hits([1, 2, 5], [7, 1, 2, 3]) == pytest.approx(1 / 3)
    assert bench.lookup_hits([4, 5, 6], [4, 5, 6, 4, 5]) == 1.0


def test_recycling_reuses_the_best_tokens_after_the_roots_latest_occurrence(bench):
    answer = [3, 8, 3, 9, 3, 8]
    tops = np.array([[9, 8], [0, 0], [8, 1], [0, 0], [0, 0], [0, 0]])  # after answer[j], best first
    # 3 -> 8: no earlier 3; 8 -> 3: no earlier 8; 3 -> 9: after the 3 of step 0 the best was 9, a hit;
    # 9 -> 3: no earlier 9; 3 -> 8: after the latest 3 (step 2) the best was 8, a hit.
    assert bench.recycled_hits(answer, tops, 1) == pytest.approx(2 / 5)
    tops[2] = [1, 8]
    assert bench.recycled_hits(answer, tops, 1) == pytest.approx(1 / 5)
    assert bench.recycled_hits(answer, tops, 2) == pytest.approx(2 / 5)


def test_an_exit_reads_its_layers_and_the_lm_head(bench, tiny_checkpoint):
    from llama_ane.checkpoint.loader import load_checkpoint
    from llama_ane.chunks.plan import layer_shapes

    cfg = load_checkpoint(tiny_checkpoint(num_hidden_layers=4)).config
    layer = sum(int(np.prod(s)) for s in layer_shapes(cfg).values() if len(s) == 2)
    head = cfg.vocab_size * cfg.hidden_size
    assert bench.exit_weight_share(cfg, 4) == 1.0
    assert bench.exit_weight_share(cfg, 1) == pytest.approx((layer + head) / (4 * layer + head))


def test_the_last_layers_exit_is_the_greedy_answer_and_early_ones_differ(bench, tiny_checkpoint, tmp_path,
                                                                          monkeypatch, capsys):
    from llama_ane.checkpoint.loader import load_checkpoint

    folder = tiny_checkpoint(num_hidden_layers=3)
    model = llama_ane.load(folder, backend="torch", precision="fp32", context_length=256, prefill_length=16,
                           branch_width=0, verify_window=0)
    prompt = [int(t) for t in np.arange(5, 40)]
    answer, tops = bench.greedy_answer(model, prompt, 12)
    assert tops.shape == (12, bench.TOP) and [int(t[0]) for t in tops[:-1]] == answer[1:]  # greedy: the best
    exits = bench.early_exit_tokens(load_checkpoint(folder), prompt, answer, [1, 3])
    assert exits[3].tolist() == answer  # transformers' arithmetic, aligned with the torch backend's steps
    assert exits[1].tolist() != answer

    monkeypatch.setattr(bench, "RESULTS", tmp_path)
    assert bench.main(["--model", str(folder), "--tasks", "chat: poem", "--new-tokens", "6", "--layers", "1,2",
                       "--name", "t"]) == 0
    row = json.loads((tmp_path / "t.json").read_text())["rows"][0]
    assert row["task"] == "chat: poem" and row["steps"] == 5 and row["early_exit"]["3"] == 1.0
    assert "exit@3" in capsys.readouterr().out


def test_bad_options_are_refused(bench, tiny_checkpoint):
    folder = str(tiny_checkpoint(num_hidden_layers=3))
    with pytest.raises(SystemExit, match=r"--layers must be 1\.\.3 \(the model has 3\)"):
        bench.main(["--model", folder, "--layers", "2,7"])
    with pytest.raises(SystemExit, match=r"--layers must be 1\.\.3 .* got 1,two"):
        bench.main(["--model", folder, "--layers", "1,two"])
    with pytest.raises(SystemExit, match="unknown task"):
        bench.main(["--model", folder, "--tasks", "translate"])
