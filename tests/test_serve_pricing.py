"""Whether the server batches (serve/pricing.py): the rule on step times given by hand, the measured
prices (fastest measurement, interpolated rows, padded windows), the device model's prices on a
planned export, and which prices each backend gets. No export, no server."""

from __future__ import annotations

import pytest

from llama_ane.contract import device_model as dm
from llama_ane.errors import InvalidArgumentError
from llama_ane.serve.pricing import (BATCH, WINDOW, DevicePrices, Group, MeasuredPrices, check_batching,
                                     prices_for)

from support.traffic import TINY

WINDOW_ROWS = 64


def manifest(**options) -> dict:
    return dm.manifest_from_config(TINY, **{"context_length": 1024, "prefill_length": WINDOW_ROWS,
                                            "branch_width": 8, **options})


def measured(times: dict[int, float], direct: bool = True, **options) -> MeasuredPrices:
    prices = MeasuredPrices(manifest(**options), direct)
    for rows, seconds in times.items():
        prices.observe(WINDOW, rows, seconds)
    return prices


def test_nothing_measured_runs_one_after_another():
    prices = MeasuredPrices(manifest(), direct=True)
    group = Group(100, [10, 10], [20, 20], lanes=2)
    assert prices.batch_seconds(group) is None and prices.sequential_seconds(group) is None
    assert not prices.batch_pays(group)


def test_a_step_is_priced_at_its_fastest_measurement_and_between_rows_on_a_line():
    prices = measured({1: 1.0, 64: 4.0})
    prices.observe(WINDOW, 1, 9.0)  # a step slowed by other work on the machine
    assert prices.measured(WINDOW, 1) == 1.0
    assert prices.measured(WINDOW, 2) == pytest.approx(1.0 + 3.0 / 63)
    assert prices.measured(WINDOW, 64) == 4.0
    assert prices.measured(WINDOW, 128) == 8.0  # past the rows measured: scaled by the rows
    assert prices.measured(BATCH, 8) is None  # no batch step measured
    prices.observe(WINDOW, 13, 50.0)  # measured once, slowed: priced as no more than a larger window
    assert prices.measured(WINDOW, 13) == 4.0


def test_two_requests_run_one_after_another_where_two_rows_cost_twice_one():
    """Prices by hand: a prefix of 100 tokens (windows of 64 and 36), requests of 10 own tokens and
    20 answer tokens each."""
    w = {1: 1.0, 2: 2.0, 8: 2.5, 64: 4.0}
    prices = measured(w)
    w36, w46, w10 = (2.5 + 1.5 * (n - 8) / 56 for n in (36, 46, 10))  # on the line between 8 and 64 rows
    two = Group(100, [10, 10], [20, 20], lanes=2)
    batch = w[64] + w36 + (10 + 20 - 1) * w[2]
    alone = (w[64] + w46) + w10 + 2 * 19 * w[1]  # the second reuses the prefix: only its own 10 tokens
    assert prices.batch_seconds(two) == pytest.approx(batch)
    assert prices.sequential_seconds(two) == pytest.approx(alone)
    assert batch > alone and not prices.batch_pays(two)
    # without a prompt cache the second prefills the prefix again (the same 110 tokens as the first)
    assert prices.sequential_seconds(Group(100, [10, 10], [20, 20], lanes=2, reused=False)) == pytest.approx(
        2 * (w[64] + w46) + 2 * 19 * w[1])

    eight = Group(100, [10] * 8, [20] * 8, lanes=8)
    batch8, alone8 = w[64] + w36 + 29 * w[8], (w[64] + w46) + 7 * w10 + 8 * 19 * w[1]
    assert prices.batch_seconds(eight) == pytest.approx(batch8)
    assert prices.sequential_seconds(eight) == pytest.approx(alone8)
    assert prices.batch_pays(eight)


def test_what_is_cached_is_left_out_of_both():
    prices = measured({1: 1.0, 2: 2.0, 64: 4.0})
    group = Group(100, [10, 10], [20, 20], lanes=2, cached=99)
    assert prices.batch_seconds(group) == pytest.approx(1.0 + 29 * 2.0)  # the prefix's last token, then steps
    # the first prefills the prefix's last token and its own 10, the second its own 10 (between 2 and 64 rows)
    assert prices.sequential_seconds(group) == pytest.approx((2.0 + 2.0 * 9 / 62) + (2.0 + 2.0 * 8 / 62) + 38 * 1.0)


def test_padded_windows_are_priced_whole():
    """A backend that pads every window to the prefill length (not torch's direct caches) computes
    the whole window for a short prompt, and for a batch step through the window."""
    prices = measured({64: 4.0, 1: 4.5}, direct=False)
    assert prices.decodes == "prefill"  # a token decodes through the prefill window too: 64 rows
    assert set(prices._known(WINDOW)) == {64}
    assert prices.window(10, 0) == 4.0 and prices.window(1, 0) == 4.0
    assert prices.cascade(2, 100) == 4.0
    with_decode = measured({1: 1.0, 64: 4.0}, direct=False, decode_function="decode")
    assert with_decode.window(10, 0) == 4.0 and with_decode.window(1, 0) == 1.0


def test_a_batch_step_is_priced_by_the_batch_steps_measured():
    """Before any batch, a batch step of 8 slots is priced as a window of 8 rows; once one has run,
    at its own time, and other slot counts as their window times what a batch step cost over its
    window (the host's work of a step: masks, each branch's tokens)."""
    prices = measured({1: 1.0, 64: 4.0}, decode_function="decode")  # with the cascade's function
    w8, w4 = 1.0 + 3.0 * 7 / 63, 1.0 + 3.0 * 3 / 63
    assert prices.cascade(8, 100) == pytest.approx(w8)
    prices.observe(BATCH, 8, 2 * w8)
    assert prices.cascade(8, 100) == pytest.approx(2 * w8)
    assert prices.cascade(4, 100) == pytest.approx(2 * w4)
    assert MeasuredPrices(manifest(), direct=True).cascade(8, 100) is None  # no window measured


def test_device_prices_batch_where_the_neural_engine_pays():
    """On the device model a step streams the weights whatever its rows: two answers over a long
    prefix pay as a batch, but not requests whose own tokens are long (fed one a step, against one
    prefill window alone)."""
    prices = DevicePrices(manifest(), dm.chip("M4"))
    assert prices.batch_pays(Group(600, [10, 10], [32, 32], lanes=8))
    assert not prices.batch_pays(Group(600, [60, 60], [2, 2], lanes=8))


def test_each_backend_gets_its_prices():
    class Backend:
        def __init__(self, name, direct_cache=False):
            self.name, self.direct_cache = name, direct_cache

    m = manifest()
    assert isinstance(prices_for(Backend("coreml"), m), DevicePrices)
    assert isinstance(prices_for(Backend("coreai"), m), DevicePrices)
    torch = prices_for(Backend("torch", direct_cache=True), m)
    assert isinstance(torch, MeasuredPrices) and torch.direct
    assert isinstance(prices_for(Backend("mil"), m), MeasuredPrices)


def test_batching_choices():
    assert check_batching("auto") == "auto"
    with pytest.raises(InvalidArgumentError, match=r"--batching 'sometimes' is not one of auto, always, never"):
        check_batching("sometimes")
