"""What each unit's compression costs in quality, measured on a float32 model in memory.

`Float32Model` holds a checkpoint's decoder layers (transformers' modules, built by the caller)
with the embedding table, the final norm and the LM head, and runs token ids through them with any
unit's weights swapped for their compressed-then-decompressed values. The inputs of every layer on
the uncompressed model are kept, so a unit's own layer can run alone on them.

`measure_units` gives, for every unit and form, its bytes and an estimate of the KL divergence of
the model's next-token distribution from the uncompressed one when that unit alone is compressed
(see quantize.auto): its layer's output error times that layer's measured gain.
`perplexity_change` runs a whole recipe on other text, end to end.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field, replace
from typing import Callable

import numpy as np
import torch

from .auto import (CANDIDATES, CLOSE, MAX_RETRIES, RETARGETS, STEP, Recipe, change_pct, choose, nll_of_pct, tally,
                   units)
from .fit import roundtrip, statistics_key
from .schemes import Compression, stored_bytes

KEPT_BYTES = 1 << 30  # decompressed units kept for measuring recipes (SmolLM2's three forms fit)
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


@dataclass
class Float32Model:
    """A decoder-only model in float32: `layers` are the family's decoder layer modules, called as
    layer(x, attention_mask=None, position_ids=..., position_embeddings=rope) (causal, sdpa);
    `rotary` gives rope from (x, positions). `embed` (V, C) and `head` (V, C) are separate
    tensors even when the checkpoint ties them (the export compresses them apart)."""

    embed: torch.Tensor
    layers: list
    norm: torch.nn.Module
    head: torch.Tensor
    rotary: torch.nn.Module
    kept: dict = field(default_factory=dict)  # (unit, form) -> compressed_unit's result, fp16
    kept_bytes: int = 0

    def weights(self, unit: str) -> dict[str, torch.Tensor]:
        """Exported parameter name -> the float32 tensor it is in this model (changed in place by `swapped`)."""
        if unit == "embeddings":
            return {"embed_tokens.weight": self.embed}
        if unit == "lm_head":
            return {"heads.weight": self.head}
        _, n, part = unit.split(".")
        layer = self.layers[int(n)]
        if part == "attention":
            return {f"layers.{n}.{p}.weight": layer.self_attn.get_submodule(p).weight.data for p in ATTENTION}
        return {f"layers.{n}.mlp.{p}.weight": layer.mlp.get_submodule(p).weight.data for p in MLP}

    @contextlib.contextmanager
    def swapped(self, values: dict[str, dict[str, np.ndarray]]):
        """Within the block, each unit's weights (unit -> name -> float32 array) replace the model's."""
        saved = []
        try:
            for unit, named in values.items():
                for name, tensor in self.weights(unit).items():
                    saved.append((tensor, tensor.clone()))
                    tensor.copy_(torch.from_numpy(named[name]))
            yield
        finally:
            for tensor, old in saved:
                tensor.copy_(old)

    def trace(self, ids: list[int]) -> tuple[list[torch.Tensor], torch.Tensor]:
        """The input of every layer (and, last, the final hidden states) on `ids`, and log-probs."""
        with torch.no_grad():
            x = self.embed[torch.tensor(ids)][None]
            inputs = []
            for layer in self.layers:
                inputs.append(x)
                x = self._layer(layer, x, len(ids))
            inputs.append(x)
            return inputs, self._log_probs(x)

    def log_probs(self, ids: list[int], start: int = 0, inputs=None) -> torch.Tensor:
        """Log-probs (T, V) on `ids`, from layer `start` on (its input `inputs[start]`: a `trace`,
        or {start: a tensor}; without, start 0 looks the tokens up); start = len(layers) runs only
        the final norm and the head."""
        with torch.no_grad():
            x = self.embed[torch.tensor(ids)][None] if inputs is None else inputs[start]
            for layer in self.layers[start:]:
                x = self._layer(layer, x, len(ids))
            return self._log_probs(x)

    def run_layer(self, n: int, x: torch.Tensor) -> torch.Tensor:
        """Layer `n` alone on its input `x` (1, T, C)."""
        with torch.no_grad():
            return self._layer(self.layers[n], x, x.shape[1])

    def _layer(self, layer, x: torch.Tensor, tokens: int) -> torch.Tensor:
        positions = torch.arange(tokens)[None]
        out = layer(x, attention_mask=None, position_ids=positions, position_embeddings=self.rotary(x, positions))
        return out[0] if isinstance(out, tuple) else out

    def _log_probs(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(self.norm(x[0]) @ self.head.T, dim=-1)


def kl(reference: torch.Tensor, other: torch.Tensor) -> float:
    """Mean over positions of KL(reference || other), both log-probs (T, V)."""
    return float((reference.exp() * (reference - other)).sum(-1).mean())


def nll(log_probs: torch.Tensor, ids: list[int]) -> float:
    """Mean negative log-likelihood of each next token of `ids`."""
    targets = torch.tensor(ids[1:])
    return float(-log_probs[:-1].gather(1, targets[:, None]).to(torch.float64).mean())


def statistics(importance: dict[str, np.ndarray], key: str, c: Compression) -> np.ndarray | None:
    """What the fit of weight `key` as `c` reads of the calibration (quantize.fit): its inputs'
    second moments for compensated codes, their mean squares for other weighted forms, else None."""
    return importance.get(statistics_key(key, c)) if c.weighted else None


def compressed_unit(model: Float32Model, unit: str, c: Compression | None,
                    importance: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], int]:
    """The unit's weights compressed as `c` says and decompressed (fitted as the export fits them,
    from fp16), and their stored bytes. Kept (as fp16) in `model.kept` while it holds less than
    KEPT_BYTES, for `perplexity_change`."""
    kept = model.kept.get((unit, c))
    if kept is not None:
        return {name: v.astype(np.float32) for name, v in kept[0].items()}, kept[1]
    values, size = {}, 0
    for name, tensor in model.weights(unit).items():
        fp16 = tensor.to(torch.float16).numpy()
        shape = tuple(fp16.shape)
        if c is None:
            values[name], size = fp16.astype(np.float32), size + stored_bytes(shape, None)
            continue
        values[name], size = (roundtrip(fp16, c, statistics(importance, "heads" if unit == "lm_head" else name, c)),
                              size + stored_bytes(shape, c))
    held = sum(v.nbytes // 2 for v in values.values())
    if c is not None and model.kept_bytes + held <= KEPT_BYTES:
        model.kept[(unit, c)] = ({n: v.astype(np.float16) for n, v in values.items()}, size)
        model.kept_bytes += held
    return values, size


def looked_up_rows(model: Float32Model, ids: list[int], c: Compression | None,
                   importance: dict[str, np.ndarray]) -> tuple[torch.Tensor, int]:
    """The rows of `ids` (1, T, C) of the table compressed as `c` says and decompressed, and the
    whole table's stored bytes. A grouped LUT's fit of a group of rows reads only those rows, so
    only the groups holding the tokens are fitted: the rows the whole table's fit gives them (up
    to where Lloyd's iterations stop, which kmeans decides for a batch of groups at once), for a
    fraction of the work (a vocabulary of 128k rows against the few hundred tokens measured on)."""
    table = model.embed
    size = stored_bytes(tuple(table.shape), c)
    if c is None:
        return table[torch.tensor(ids)][None].to(torch.float16).to(torch.float32), size
    group = c.group_size if c.kind == "lut" and c.group_size else 0
    if not group:
        values, _ = compressed_unit(model, "embeddings", c, importance)
        return torch.from_numpy(values["embed_tokens.weight"])[torch.tensor(ids)][None], size
    groups = torch.unique(torch.tensor(ids) // group)
    rows = (groups[:, None] * group + torch.arange(group)).reshape(-1)  # every row of those groups
    fitted = torch.from_numpy(roundtrip(table[rows].to(torch.float16).numpy(), c,
                                        statistics(importance, "embed_tokens.weight", c)))
    at = torch.searchsorted(rows, torch.tensor(ids))
    return fitted[at][None], size


def layer_of(unit: str, layers: int) -> int:
    """The layer whose output a unit's compression first changes (-1: the table, `layers`: the head)."""
    if unit == "embeddings":
        return -1
    if unit == "lm_head":
        return layers
    return int(unit.split(".")[1])


def measure_units(model: Float32Model, ids: list[int], candidates: tuple[Compression, ...],
                  importance: dict[str, np.ndarray], say: Callable[[str], None] = lambda _: None,
                  on_unit: Callable[[str], None] = lambda _: None) -> dict:
    """{unit: {form: (bytes, KL)}} for every unit and candidate form (and fp16, KL 0) on `ids`.

    Layer-local: the inputs of every layer are captured once, and each unit and form runs only
    its own layer on them, giving the mean squared error of the layer's output (the looked-up
    rows, for the embeddings: only the groups holding them are fitted, `looked_up_rows`). Per
    layer one pass runs from there to the end, with the first candidate of its MLP (the largest
    error): the KL it causes over that error is the layer's gain, and every unit of the layer is
    estimated as gain x its error (a small error's KL grows with its square, which the error is).
    The LM head is measured directly (only the head runs). The table (looked up: no inputs to
    compensate) takes the candidates without compensation. So a model of N layers costs N + 1
    partial passes and one run of a single layer per unit and form, instead of a pass per unit and
    form. `on_unit(note)` follows each unit ("layers.3.mlp: lut4 KL 0.0123")."""
    t0 = time.perf_counter()
    inputs, reference = model.trace(ids)
    n = len(model.layers)
    costs: dict[str, dict] = {}
    gains: dict[int, float] = {}
    for unit in reversed(units(n)):  # the MLP (which probes the layer's gain) before the attention
        _, fp16_bytes = compressed_unit(model, unit, None, importance)
        costs[unit] = {None: (fp16_bytes, 0.0)}
        layer = layer_of(unit, n)
        for c in (candidates if layer >= 0 else [replace(c, compensated=False) for c in candidates]):
            if layer < 0:
                out, size = looked_up_rows(model, ids, c, importance)
            else:
                values, size = compressed_unit(model, unit, c, importance)
                with model.swapped({unit: values}):
                    if layer == n:
                        costs[unit][c] = (size, max(kl(reference, model.log_probs(ids, n, inputs)), 0.0))
                        continue
                    out = model.run_layer(layer, inputs[layer])
            error = float(((out - inputs[layer + 1]) ** 2).sum(-1).mean())
            if layer not in gains:
                divergence = max(kl(reference, model.log_probs(ids, layer + 1, {layer + 1: out})), 0.0)
                gains[layer] = divergence / max(error, 1e-30)
            costs[unit][c] = (size, gains[layer] * error)
        on_unit(f"{unit}: {candidates[0].scheme} KL {list(costs[unit].values())[1][1]:.4g}")
    costs = {u: costs[u] for u in units(n)}
    say(f"measured {len(costs)} units on {len(ids)} tokens in {time.perf_counter() - t0:.0f} s "
        f"({len(gains)} partial passes)")
    return {"costs": costs, "passes": len(gains)}


def perplexity_change(model: Float32Model, forms: dict[str, Compression | None], ids: list[int],
                      importance: dict[str, np.ndarray], on_step: Callable[[str], None] = lambda _: None) -> float:
    """Perplexity change, percent, on `ids` when every unit takes its form of `forms` at once.
    `on_step(note)` follows each of its len(forms) + 1 steps: each unit compressed, then the pass."""
    base = nll(model.log_probs(ids), ids)
    values = {}
    for u, c in forms.items():
        if c is not None:
            values[u] = compressed_unit(model, u, c, importance)[0]
        on_step(u)
    with model.swapped(values):
        after = nll(model.log_probs(ids), ids)
    on_step("the whole recipe run")
    return 100 * (math.exp(after - base) - 1)


class _NoProgress:
    """What `choose_recipe` shows of a phase without a `phase` factory: nothing."""

    def __init__(self, *_args, **_kwargs):
        pass

    def advance(self, note: str = "", count: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def choose_recipe(model: Float32Model, calibration_ids: list[int], check_ids: list[int],
                  importance: dict[str, np.ndarray], budget_pct: float, check_text: str,
                  say: Callable[[str], None] = lambda _: None, found: dict | None = None,
                  phase: Callable = _NoProgress) -> Recipe:
    """`--quantize auto`: measure every unit on `calibration_ids`, choose the fewest bytes whose
    estimated perplexity increase fits `budget_pct`, then measure that recipe on `check_ids` (text
    the choice never saw), and choose again (`search`) until one measures close under the budget.
    `found`: `measure_units`' result, when measured before (for several budgets).
    `phase(desc, total, unit=...)` makes the progress of each phase (export.progress.StepProgress:
    `.advance(note)`, `.close()`); each choice is said as it is made, before it is checked."""
    if found is None:
        layers = len(model.layers)
        bar = phase("auto: measuring", len(units(layers)), unit="unit")
        try:
            found = measure_units(model, calibration_ids, CANDIDATES, importance, say, on_unit=bar.advance)
        finally:
            bar.close()
    costs = found["costs"]

    def measure(forms: dict, attempt: int) -> Recipe:
        estimated = change_pct(sum(costs[u][f][1] for u, f in forms.items()))
        size = sum(costs[u][f][0] for u, f in forms.items())
        say(f"auto: choice {attempt + 1}: {tally(forms)}; {size / 1e6:.1f} MB of weights, perplexity "
            f"{estimated:+.2f}% estimated (budget {budget_pct:g}%)")
        bar = phase(f"auto: checking choice {attempt + 1}", len(forms) + 1, unit="step")
        try:
            measured = perplexity_change(model, forms, check_ids, importance, on_step=bar.advance)
        finally:
            bar.close()
        say(f"auto: {size / 1e6:.1f} MB of weights, perplexity {estimated:+.2f}% estimated, {measured:+.2f}% "
            f"measured on {len(check_ids)} tokens of {check_text} (budget {budget_pct:g}%)")
        return Recipe(forms, budget_pct, round(estimated, 2), round(measured, 2),
                      f"{len(check_ids)} tokens of {check_text}", extra={"weight_bytes": size})

    return search(costs, budget_pct, measure)


def search(costs: dict, budget_pct: float, measure: Callable[[dict, int], Recipe]) -> Recipe:
    """The recipe of fewest bytes that `measure(forms, attempt)` finds within `budget_pct`, over at
    most MAX_RETRIES + 1 choices. The estimate's budget (the target `choose` fits) starts at the
    budget and moves by the ratio of the budget to what the last choice measured, both ways: down
    when a choice measured over the budget, up when it left room (estimates run high as well as
    low), within the targets already seen to measure within and over. It stops once a choice
    measures within the budget and over CLOSE of it, or when no target between those seen chooses
    anything new. Without a choice within the budget, the one that measured least wins."""
    budget = nll_of_pct(budget_pct)
    target, within, over = budget, 0.0, math.inf  # targets whose choices measured within / over the budget
    seen: dict[frozenset, Recipe] = {}
    tighter = False  # whether the last choice measured over the budget
    for attempt in range(MAX_RETRIES + 1):
        forms = choose(costs, target)
        for _ in range(RETARGETS):  # a choice already measured: move on the way the last one pointed
            if frozenset(forms.items()) not in seen:
                break
            toward = within if tighter else over
            target = (target + toward) / 2 if toward < math.inf else target * 2
            forms = choose(costs, target)
        else:
            break
        recipe = seen[frozenset(forms.items())] = measure(forms, attempt)
        tighter = recipe.measured_pct > budget_pct
        if tighter:
            over = min(over, target)
        else:
            within = max(within, target)
            if recipe.measured_pct >= CLOSE * budget_pct:
                break
        ratio = budget / nll_of_pct(recipe.measured_pct) if recipe.measured_pct > 0 else STEP
        target = min(max(target * ratio, target / STEP), target * STEP)
        if not within < target < over:  # past a target already measured: between the two
            if over == math.inf:
                target = within * STEP
            else:
                target = math.sqrt(within * over) if within > 0 else over / 2
    fits = [r for r in seen.values() if r.measured_pct <= budget_pct]
    if fits:
        return min(fits, key=lambda r: (r.extra["weight_bytes"], r.measured_pct))
    return min(seen.values(), key=lambda r: r.measured_pct)
