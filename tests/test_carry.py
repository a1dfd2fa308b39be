"""runtime.carry: how a function carries the states beside the K/V, read from its manifest entry
(as the Swift host's PipelineWiring.carry reads it), and the moves of each state's carry rules."""

from __future__ import annotations

import numpy as np
import pytest

from llama_ane.contract.manifest import ManifestError
from llama_ane.model.names import CARRIED, CONV, DELTA, WINDOW_TOKENS
from llama_ane.runtime.carry import BRANCHES, FROM_OUTPUT, IN_STATE, NONE, branch_copies, carry_mode, move


def entry(inputs=(), outputs=(), states=()) -> dict:
    spec = lambda name: {"name": name, "shape": [1], "dtype": "float16"}  # noqa: E731
    out = {"inputs": [spec(n) for n in ("hidden_states", *inputs)],
           "outputs": [spec(n) for n in ("hidden_states_out", *outputs)]}
    return {**out, "states": [spec(n) for n in states]} if states else out


@pytest.mark.parametrize("carried", CARRIED, ids=lambda c: c.key)
def test_each_mode_comes_from_what_the_function_reads_and_returns(carried):
    assert carry_mode(entry([carried.state], [carried.new]), carried, "chunk_0 (prefill)") == FROM_OUTPUT
    assert carry_mode(entry([carried.branches], [carried.new]), carried, "chunk_0 (decode_branches)") == BRANCHES
    assert carry_mode(entry([WINDOW_TOKENS], [], [carried.state]), carried, "chunk_0 (decode)") == IN_STATE
    assert carry_mode(entry(["k_cache"], ["k_new"]), carried, "chunk_0 (decode)") == NONE
    other = next(c for c in CARRIED if c != carried)  # the other state's names say nothing of this one
    assert carry_mode(entry([other.state], [other.new]), carried, "chunk_0 (decode)") == NONE


@pytest.mark.parametrize("carried", CARRIED, ids=lambda c: c.key)
def test_a_function_that_does_not_hold_its_state_together_is_refused_by_name(carried):
    with pytest.raises(ManifestError, match=f"chunk_1 \\(decode\\) does not return {carried.new}, but its "
                                            f"{carried.state} is carried by the host from it"):
        carry_mode(entry([carried.state], []), carried, "chunk_1 (decode)")
    with pytest.raises(ManifestError, match=f"returns {carried.new}, but its {carried.state} is a state it writes itself"):
        carry_mode(entry([WINDOW_TOKENS], [carried.new], [carried.state]), carried, "chunk_1 (decode)")
    with pytest.raises(ManifestError, match=f"holds {carried.state} as a state but does not read {WINDOW_TOKENS}"):
        carry_mode(entry([], [], [carried.state]), carried, "chunk_1 (decode)")
    with pytest.raises(ManifestError, match=f"does not return {carried.new}"):
        carry_mode(entry([carried.branches], []), carried, "chunk_1 (decode_branches)")


def test_a_conv_state_moves_on_by_the_windows_real_values():
    state = np.arange(4, dtype=np.float32).reshape(1, 1, 1, 4)
    new = np.arange(10, 13, dtype=np.float32).reshape(1, 1, 1, 3)
    assert move(CONV.after_window, state, new, 2).ravel().tolist() == [2, 3, 10, 11]
    assert move(CONV.after_window, state, new, 3).ravel().tolist() == [3, 10, 11, 12]
    branches = branch_copies(CONV.copy_to_branches, state, 2)
    assert branches.shape == (1, 1, 2, 4) and (branches == state).all()
    stepped = move(CONV.after_branch_step, branches, np.array([20, 21], np.float32).reshape(1, 1, 1, 2))
    assert stepped[0, 0].tolist() == [[1, 2, 3, 20], [1, 2, 3, 21]]


def test_a_recurrent_state_is_replaced_whole():
    state, new = np.zeros((2, 3, 1, 4), np.float16), np.ones((2, 3, 1, 4), np.float32)
    after = move(DELTA.after_window, state, new)
    assert after.dtype == np.float16 and (after == 1).all()
    rows = branch_copies(DELTA.copy_to_branches, np.arange(2, dtype=np.float32).reshape(2, 1, 1, 1), 3)
    assert rows.ravel().tolist() == [0, 0, 0, 1, 1, 1]  # layer-major: each layer's row per branch
    with pytest.raises(ValueError, match=r"a state of shape \(1, 3, 1, 4\) cannot replace one of shape \(2, 3, 1, 4\)"):
        move(DELTA.after_branch_step, state, new[:1])
    with pytest.raises(ValueError, match="no carry rule 'sideways'"):
        move("sideways", state, new)
