"""`--quantize auto`: a compression per part and per layer, the fewest bytes within a perplexity budget.

The model is cut into units: "embeddings", "lm_head", and "layers.N.attention" / "layers.N.mlp"
for every decoder layer N. Each unit may take any of CANDIDATES (forms the Neural Engine
decompresses just in time: grouped LUTs of 4, 6 and 8 bits) or stay fp16. What a unit costs in
quality is estimated (quantize.sensitivity): the KL divergence of the model's next-token
distribution from fp16's when that unit alone is compressed, on calibration text, as its layer's
output error times that layer's measured gain. For small
errors the extra negative log-likelihood of text is about that KL, and the units' KLs add, so a
recipe's perplexity increase is estimated as exp(sum of its units' KL) - 1.

`choose` finds the recipe of fewest bytes whose estimate fits the budget: for a price lambda on
KL, every unit takes the form of least bytes + lambda * KL, and lambda is bisected to the
cheapest that fits (a Lagrangian relaxation of the multiple-choice knapsack). The export then
measures the chosen recipe end to end on other text and, when the measured increase exceeds the
budget, or well under it, scales the estimate's budget by the ratio and chooses again; the
fewest bytes measured within the budget win.

A recipe is JSON (`Recipe.save` / `Recipe.load`): `--quantize-recipe FILE` reuses one, and the
manifest records it.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

from .schemes import PARTS, SCHEMES, Compression, QuantizeError

DEFAULT_BUDGET_PCT = 2.0  # --quantize-budget: perplexity increase allowed, percent (SmolLM2: lut6's KL in
# 91% of its bytes; docs/quantization.md)
WARN_PCT = 10.0  # a measured increase beyond this is said plainly at export
CANDIDATES = (Compression("lut4", group_size=16, block_size=0, scaled=True, compensated=True),
              Compression("lut6", group_size=8, compensated=True),
              Compression("lut8", group_size=16))  # Apple's guide: groups of 8 or 16 keep LUTs fast; the
# per-channel scale halves lut4's loss on SmolLM2 (both are decompressed just in time on the ANE);
# compensated codes are the same ops and bytes with less output error (the table, which is looked
# up, takes plain ones)
FORM_FIELDS = ("scheme", "group_size", "block_size", "symmetric", "compensated")  # of a form's JSON
RECIPE_FORMAT = "llama-ane-quantize-recipe"
RECIPE_VERSION = 1
MAX_RETRIES = 3  # re-choices after the first, each checked end to end
CLOSE = 0.8  # a choice measured within the budget and over this share of it is not chosen again
STEP = 4.0  # the most one re-choice scales the estimate's budget by, either way
RETARGETS = 30  # targets tried (no check) for a re-choice that differs from every choice checked
SENSITIVITY_TOKENS = 128  # of the calibration text after the calibration's own, each unit's KL is estimated on
CHECK_TOKENS = 512  # of the eval text, a whole recipe is measured on

_LAYER_WEIGHT = re.compile(r"layers\.(\d+)\.(mlp\.)?\w*proj\.weight")
_UNIT = re.compile(r"embeddings|lm_head|layers\.(\d+)\.(attention|mlp)")


def unit_of(name: str) -> str | None:
    """The unit of an exported parameter ("layers.3.q_proj.weight" -> "layers.3.attention",
    "heads.0.weight" -> "lm_head"), or None for what is never compressed (norms, RoPE tables)."""
    if name == "embed_tokens.weight":
        return "embeddings"
    if name.startswith("heads."):
        return "lm_head"
    m = _LAYER_WEIGHT.fullmatch(name)
    if m is None:
        return None
    return f"layers.{m.group(1)}.{'mlp' if m.group(2) else 'attention'}"


def units(layers: int) -> list[str]:
    """Every unit of a model of `layers` decoder layers, in the order the model runs them."""
    return (["embeddings"] + [f"layers.{n}.{p}" for n in range(layers) for p in ("attention", "mlp")]
            + ["lm_head"])


def part_of_unit(unit: str) -> str:
    """"layers.3.mlp" -> "mlp"; "embeddings" and "lm_head" are parts of their own."""
    return unit.rsplit(".", 1)[-1]


def label(c: Compression | None) -> str:
    """A form in a few words: "lut6 group 8", "lut4 group 16, scaled per channel", "lut4 per tensor,
    scaled per block 32", "int8 per channel", "int4 block 32", "fp16"."""
    if c is None:
        return "fp16"
    if c.kind == "lut":
        text = f"{c.scheme} " + ("per tensor" if c.group_size == 0 else f"group {c.group_size}")
        if c.scaled:
            text += ", scaled per " + ("channel" if c.block_size == 0 else f"block {c.block_size}")
        if c.compensated:
            text += ", compensated"
        return text
    return f"{c.scheme} " + ("per channel" if c.block_size == 0 else f"block {c.block_size}")


def from_dict(d: object, where: str) -> Compression | None:
    """A Compression from its manifest/recipe form ({"scheme": "lut6", "group_size": 8}), checked;
    None for {"scheme": "none"}. `where` names the entry in errors."""
    if not isinstance(d, dict) or not isinstance(d.get("scheme"), str):
        raise QuantizeError(f"{where} must be an object with a \"scheme\" ({', '.join(SCHEMES)})")
    scheme = d["scheme"]
    if scheme not in SCHEMES:
        raise QuantizeError(f"{where}: scheme {scheme!r} is not one of {', '.join(SCHEMES)}")
    unknown = set(d) - set(FORM_FIELDS)
    if unknown:
        raise QuantizeError(f"{where}: unknown field(s) {', '.join(sorted(unknown))}")
    for key in ("group_size", "block_size"):
        if key in d and (not isinstance(d[key], int) or isinstance(d[key], bool) or d[key] < 0):
            raise QuantizeError(f"{where}: {key} must be an integer >= 0, got {d[key]!r}")
    for key in ("symmetric", "compensated"):
        if key in d and not isinstance(d[key], bool):
            raise QuantizeError(f"{where}: {key} must be true or false, got {d[key]!r}")
    if scheme == "none":
        return None
    if scheme.startswith("lut"):
        if "symmetric" in d:
            raise QuantizeError(f"{where}: symmetric is a field of integer schemes, not of {scheme}")
        compensated = d.get("compensated", False)
        if compensated and d.get("block_size"):
            raise QuantizeError(f"{where}: compensated codes need a LUT scaled per channel at most (block_size 0)")
        if "block_size" in d:
            return Compression(scheme, group_size=d.get("group_size", 0), block_size=d["block_size"], scaled=True,
                               compensated=compensated)
        return Compression(scheme, group_size=d.get("group_size", 0), compensated=compensated)
    for key in ("group_size", "compensated"):
        if key in d:
            raise QuantizeError(f"{where}: {key} is a field of LUT schemes, not of {scheme}")
    return Compression(scheme, block_size=d.get("block_size", 0), symmetric=d.get("symmetric", False))


@dataclass(frozen=True)
class Recipe:
    """The compression of every unit (units missing from `forms` stay fp16), and how it was chosen
    and measured (None where it was not: a recipe written by hand)."""

    forms: dict[str, Compression | None]
    budget_pct: float | None = None
    estimated_pct: float | None = None  # from the units' measured KLs, on the calibration text
    measured_pct: float | None = None  # end to end, on `measured_on`
    measured_on: str | None = None
    extra: dict = field(default_factory=dict)  # anything else worth recording (e.g. the proxy's rank correlation)

    def compression(self, unit: str) -> Compression | None:
        return self.forms.get(unit)

    def part_form(self, part: str | None = None) -> Compression | None:
        """The most lossy form among `part`'s units (among all units without `part`)."""
        return most_lossy([c for u, c in self.forms.items() if part is None or part_of_unit(u) == part])

    def part_summary(self, part: str) -> dict[str, int]:
        """How many of `part`'s units take each form (see `summary`)."""
        return summary(self.forms, part)

    def check(self, layers: int) -> None:
        """Refuse a recipe naming units the model does not have."""
        known = set(units(layers))
        bad = sorted(set(self.forms) - known)
        if bad:
            raise QuantizeError(f"the recipe names {', '.join(bad[:3])}{' ...' if len(bad) > 3 else ''}, which this "
                                f"model (layers 0..{layers - 1}) does not have; units are embeddings, lm_head and "
                                "layers.N.attention / layers.N.mlp")

    def to_dict(self) -> dict:
        out = {"format": RECIPE_FORMAT, "version": RECIPE_VERSION,
               "units": {u: (c.to_dict() if c else {"scheme": "none"}) for u, c in self.forms.items()}}
        for key in ("budget_pct", "estimated_pct", "measured_pct", "measured_on"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        out.update(self.extra)
        return out

    @classmethod
    def from_json(cls, d: object, where: str = "the recipe") -> "Recipe":
        if isinstance(d, dict) and isinstance(d.get("quantization"), dict) and "recipe" in d["quantization"]:
            d = d["quantization"]["recipe"]  # an export's manifest.json
        if not isinstance(d, dict) or d.get("format") != RECIPE_FORMAT:
            raise QuantizeError(f"{where} is not a quantization recipe (\"format\": \"{RECIPE_FORMAT}\"); write one "
                                "with --quantize auto (the export's quantize_recipe.json) or by hand")
        if d.get("version") != RECIPE_VERSION:
            raise QuantizeError(f"{where} has version {d.get('version')!r}; this llama-ane reads version "
                                f"{RECIPE_VERSION}: choose it again with --quantize auto")
        forms = d.get("units")
        if not isinstance(forms, dict) or not forms:
            raise QuantizeError(f"{where} needs \"units\": an object of unit -> {{\"scheme\": ...}}")
        for unit in forms:
            if not isinstance(unit, str) or not _UNIT.fullmatch(unit):
                raise QuantizeError(f"{where}: {unit!r} is not a unit (embeddings, lm_head, layers.N.attention, "
                                    "layers.N.mlp)")
        budget = d.get("budget_pct")
        if budget is not None and (not isinstance(budget, (int, float)) or isinstance(budget, bool)):
            raise QuantizeError(f"{where}: budget_pct must be a number, got {budget!r}")
        measured = {key: d[key] for key in ("estimated_pct", "measured_pct") if isinstance(d.get(key), (int, float))}
        on = d.get("measured_on") if isinstance(d.get("measured_on"), str) else None
        return cls({u: from_dict(c, f"{where}: units.{u}") for u, c in forms.items()}, budget_pct=budget,
                   measured_on=on, **measured)

    def save(self, path: Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n", encoding="utf-8")

    @classmethod
    def load(cls, path: str | Path) -> "Recipe":
        """Read `path` (untrusted): one QuantizeError naming the file and the problem."""
        path = Path(path).expanduser()
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise QuantizeError(f"cannot read --quantize-recipe {path}: {getattr(e, 'strerror', None) or e}") from None
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise QuantizeError(f"--quantize-recipe {path} is not JSON (line {e.lineno}: {e.msg})") from None
        return cls.from_json(d, f"--quantize-recipe {path}")


def change_pct(nll: float) -> float:
    """A mean negative log-likelihood increase as a perplexity change, percent."""
    return 100 * (math.exp(nll) - 1)


def nll_of_pct(pct: float) -> float:
    return math.log1p(pct / 100)


def choose(costs: dict[str, dict[Compression | None, tuple[int, float]]], budget_nll: float) -> dict[str, Compression | None]:
    """The form of each unit, of fewest total bytes with the sum of the units' KL within `budget_nll`.

    `costs[unit][form] = (bytes, kl)`, None the fp16 form (KL 0). A Lagrangian relaxation: at price
    lam every unit takes the form minimising bytes + lam * kl; lam is bisected to the least that fits.
    """
    def pick(lam: float) -> dict[str, Compression | None]:
        return {u: min(options, key=lambda f: (options[f][0] + lam * options[f][1], options[f][1]))
                for u, options in costs.items()}

    def kl(choice: dict) -> float:
        return sum(costs[u][f][1] for u, f in choice.items())

    if kl(pick(0.0)) <= budget_nll:
        return pick(0.0)
    low, high = 0.0, 1.0
    while kl(pick(high)) > budget_nll:
        high *= 4
        if high > 1e30:  # nothing fits but fp16
            return pick(high)
    for _ in range(60):
        mid = (low + high) / 2
        if kl(pick(mid)) > budget_nll:
            low = mid
        else:
            high = mid
    choice = pick(high)
    return _spend_leftover(choice, costs, budget_nll - kl(choice))


def _spend_leftover(choice: dict, costs: dict, slack: float) -> dict:
    """Step units down to fewer bytes while the budget's slack allows, most bytes saved per KL
    first (the Lagrangian choice stops at a price where whole groups of units switch at once)."""
    choice = dict(choice)
    while True:
        best = None
        for u, f in choice.items():
            b, k = costs[u][f]
            for g, (b2, k2) in costs[u].items():
                if b2 < b and k2 - k <= slack:
                    gain = (b - b2) / max(k2 - k, 1e-12)
                    if best is None or gain > best[0]:
                        best = (gain, u, g, k2 - k)
        if best is None:
            return choice
        _, u, g, dk = best
        choice[u] = g
        slack -= dk


def most_lossy(forms: list[Compression | None]) -> Compression | None:
    """The form of fewest bits (a LUT before integers of as many bits: the parity gate's order)."""
    compressed = [c for c in forms if c is not None]
    return min(compressed, key=lambda c: (c.bits, c.kind != "lut"), default=None)


def short(c: Compression | None) -> str:
    """A form by its scheme alone: "lut6", "lut4", "fp16"."""
    return "fp16" if c is None else c.scheme


def tally(forms: dict[str, Compression | None], name=short) -> str:
    """How many units take each form (by `name`: its scheme, or `label`), most first: "55 of 60
    units lut6, 5 lut4" (every unit counted; "all 60 units lut6" when they agree)."""
    counts: dict[str, int] = {}
    for c in forms.values():
        counts[name(c)] = counts.get(name(c), 0) + 1
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    total = len(forms)
    if len(ranked) == 1:
        return f"all {total} units {ranked[0][0]}" if total > 1 else f"1 unit {ranked[0][0]}"
    head = f"{ranked[0][1]} of {total} units {ranked[0][0]}"
    return ", ".join([head] + [f"{n} {form}" for form, n in ranked[1:]])


def recipe_label(forms: dict[str, Compression | None]) -> str:
    """A recipe exactly: its units per form, then per part, then what each scheme's form is:
    "5 of 8 units lut6, 2 lut8, 1 lut4 (embeddings lut8; attention lut6; mlp 2 lut6, 1 lut4;
    lm_head lut8; lut8: group 16; lut6: group 8, compensated; lut4: group 16, scaled per channel)".
    Forms are named by their scheme where each scheme has one form in the recipe, up to
    compensated codes taken by whole parts ("lut6: group 8, compensated (plain in embeddings)":
    the table is looked up, so never compensated); else in full."""
    schemes: dict[str, set] = {}  # scheme -> its forms, compensated or not
    by_part: dict[tuple, set] = {}  # (part, scheme) -> whether its units are compensated
    for u, c in forms.items():
        schemes.setdefault(short(c), set()).add(None if c is None else replace(c, compensated=False))
        by_part.setdefault((part_of_unit(u), short(c)), set()).add(c is not None and c.compensated)
    name = short if all(len(v) == 1 for v in (*schemes.values(), *by_part.values())) else label
    parts = []
    for part in PARTS:
        mine = {u: c for u, c in forms.items() if part_of_unit(u) == part}
        if mine:
            counts = tally(mine, name)
            parts.append(f"{part} " + (name(next(iter(mine.values()))) if counts.startswith(("all ", "1 unit"))
                                       else counts.replace(f" of {len(mine)} units", "")))
    spelled = []
    if name is short:
        for scheme, (c,) in schemes.items():
            if c is None:
                continue
            ways = {p: next(iter(way)) for (p, s), way in by_part.items() if s == scheme}
            text = f"{scheme}: {label(replace(c, compensated=any(ways.values()))).removeprefix(scheme + ' ')}"
            if any(ways.values()) and not all(ways.values()):
                text += f" (plain in {', '.join(p for p in PARTS if ways.get(p) is False)})"
            spelled.append(text)
    return f"{tally(forms, name)} ({'; '.join(parts + spelled)})"


def recipe_forms(quantization: dict) -> dict[str, Compression | None] | None:
    """Each unit's form under the recipe of a manifest's quantization section; None without one
    (or with one this reader cannot parse)."""
    recipe = quantization.get("recipe")
    if not isinstance(recipe, dict) or not isinstance(recipe.get("units"), dict):
        return None
    try:
        return {u: from_dict(d, u) for u, d in recipe["units"].items()} or None
    except QuantizeError:
        return None


def weights_label(quantization: dict) -> str:
    """How an export's weights are compressed, exactly, from its manifest's quantization section
    (QuantizeOptions.describe): under a recipe `recipe_label` ("auto recipe: ..."), else each part's
    form ("lut6 group 8 (every part)", "embeddings lut8 group 16; attention lut4 group 16, scaled
    per channel; ..."), "fp16" when none is compressed. What this reader cannot parse is shown by
    its scheme."""
    forms = recipe_forms(quantization)
    if forms:
        return f"{'auto ' if quantization['recipe'].get('budget_pct') is not None else ''}recipe: {recipe_label(forms)}"
    described = {}
    for part, d in quantization.items():
        if part == "recipe" or not isinstance(d, dict):
            continue
        try:
            described[part] = label(from_dict({k: v for k, v in d.items()
                                               if k in FORM_FIELDS}, part))
        except QuantizeError:
            described[part] = str(d.get("scheme"))
    if not described or all(v == "fp16" for v in described.values()):
        return "fp16"
    if len(set(described.values())) == 1 and len(described) == len(PARTS):
        return f"{next(iter(described.values()))} (every part)"
    return "; ".join(f"{part} {form}" for part, form in described.items())


def summary(forms: dict[str, Compression | None], part: str) -> dict[str, int]:
    """How many of `part`'s units take each form ("lut6 group 8": 12, ...)."""
    counts: dict[str, int] = {}
    for unit, c in forms.items():
        if part_of_unit(unit) == part:
            counts[label(c)] = counts.get(label(c), 0) + 1
    return counts


def device_paths(quantization: dict) -> dict[str, str]:
    """Part -> how the Neural Engine runs its weights, from a manifest's quantization section:
    "fp16", a form with its device path ("lut6 group 8: just-in-time"), or under a recipe the
    forms of its units ("20 x lut6 group 8: just-in-time, 10 x lut4 group 16: just-in-time").
    Entries this reader cannot parse are shown by their scheme alone."""
    out = {}
    for part, d in quantization.items():
        if part == "recipe" or not isinstance(d, dict):
            continue
        if isinstance(d.get("units"), dict):
            forms = []
            for form, n in d["units"].items():
                c = _parse_label(form)
                forms.append(f"{n} x {form if c is None else label(c)}" + (f": {c.device_path}" if c is not None else ""))
            out[part] = ", ".join(forms)
            continue
        try:
            c = from_dict({k: v for k, v in d.items() if k in FORM_FIELDS},
                          part)
        except QuantizeError:
            out[part] = str(d.get("scheme"))
            continue
        out[part] = "fp16" if c is None else f"{label(c)}: {c.device_path}"
    return out


def _parse_label(text: str) -> Compression | None:
    """The form `label` wrote as `text`, or None (fp16, or text it did not write)."""
    for c in _LABELLED:
        if label(c) == text:
            return c
    m = re.fullmatch(r"(lut\d) (?:group (\d+)|per tensor)(?:, scaled per (?:block (\d+)|(?:per )?channel))?"
                     r"(, compensated)?", text)
    # ("scaled per per channel": how exports before the fix spelled a per-channel scale)
    if m is None or m.group(1) not in SCHEMES:
        return None
    group = int(m.group(2) or 0)
    if ", scaled" in text:
        return Compression(m.group(1), group_size=group, block_size=int(m.group(3) or 0), scaled=True,
                           compensated=bool(m.group(4)))
    return Compression(m.group(1), group_size=group, compensated=bool(m.group(4)))


_LABELLED = CANDIDATES
