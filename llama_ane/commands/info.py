"""`llama-ane info`: what an export folder holds, from its manifest, and its modelled cost per chip;
or, with --config, the same model of an export not made yet. OUT may be a Hugging Face repo id of
an export, and --config one of a checkpoint (only its config.json is fetched)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from ..contract.options import DECODE_CHOICES, EXPORT_OPTIONS, FOLD_CHOICES, KV_CACHE_CHOICES, TARGETS
from ..errors import InvalidArgumentError
from .errors import user_errors
from .options import FiniteFloat, PathOrRepo, revision_option

# options that describe the export a --config is modelled as (an export folder records its own)
CONFIG_ONLY = ("context_length", "quantize", "target", "kv_cache", "fold_lm_head", "decode_function")


@click.command("info")
@click.argument("out", required=False, type=PathOrRepo())
@click.option("--config", "config_path", type=PathOrRepo(), default=None, metavar="CONFIG.json",
              help="Model a Hugging Face config.json (a file, a folder holding one, or a checkpoint's repo id) as "
                   "an export with the options below, without exporting it.")
@revision_option("OUT or --config")
@click.option("--context-length", type=int, default=None, help="With --config: the context length [default: 1024].")
@click.option("--quantize", default=None, metavar="SCHEME",
              help="With --config: the weights' scheme (none, int8, int4, lut8, lut6, lut4) [default: none].")
@click.option("--target", type=click.Choice(TARGETS), default=None, help="With --config: the deployment target "
              "[default: iOS18].")
@click.option("--kv-cache", "kv_cache", type=click.Choice(KV_CACHE_CHOICES), default=None,
              help="With --config: where the K/V caches live (auto: state where it works) [default: auto].")
@click.option("--fold-lm-head", "fold_lm_head", type=click.Choice(FOLD_CHOICES), default=None,
              help="With --config: the last chunk computes the LM head (auto: where it fits) [default: auto].")
@click.option("--decode-function", "decode_function", type=click.Choice(DECODE_CHOICES), default=None,
              help="With --config: what decodes a token, a function of its own or the prefill window's (auto: "
                   "the prefill window's on Core ML, its own on Core AI) [default: "
                   f"{next(o.default for o in EXPORT_OPTIONS if o.name == 'decode_function')}].")
@click.option("--filled", type=int, default=None,
              help="Positions already cached at the modelled decode step (and the prefix of --branches) "
                   "[default: the context length less one].")
@click.option("--chip", default=None, metavar="NAME", help="Model this chip only (M1, M4 Max, A18 Pro, ...) "
              "[default: every chip in the table].")
@click.option("--prompt-length", type=int, default=None, metavar="P",
              help="Add the modelled time to first token of a P-token prompt.")
@click.option("--branches", type=int, default=None, metavar="B",
              help="Add the modelled tokens/s of B cascade branches over --filled prefix tokens.")
@click.option("--bandwidth", type=FiniteFloat(minimum=0, min_open=True, unit="GB/s"), default=None, metavar="GB/S",
              help="Memory bandwidth of a device: adds the decode tokens/s that bandwidth bounds (an upper "
                   "bound, not a measurement).")
@click.option("--json", "as_json", is_flag=True,
              help="Print the manifest, with the decode step's traffic and the modelled costs, as JSON.")
def command(out, config_path, revision, context_length, quantize, target, kv_cache, fold_lm_head, decode_function,
            filled, chip, prompt_length, branches, bandwidth, as_json):
    """Describe the export in OUT (the hashes are checked), or the export a --config would make: its
    models, weights, the bytes and Core ML calls of one decode step, and its modelled tokens/s per
    Apple chip.

    What it reads of OUT's files (their sha256, the bytes each function adds) is remembered in the
    user's cache folder for each file as it is, so a second `info` reads no file again.

    OUT may be a Hugging Face repo id of an export, and --config one of a checkpoint."""
    from ..contract.device_model import CHIPS, chip as find_chip, manifest_from_config, read_config, report
    from ..contract.manifest import decode_function as decoded_by, kv_cache_kind
    from ..contract.resident import resident
    from ..contract.traffic import decode_step_traffic
    from ..hub import locate

    given = {"context_length": context_length, "quantize": quantize, "target": target, "kv_cache": kv_cache,
             "fold_lm_head": fold_lm_head, "decode_function": decode_function}
    known = None  # what an earlier `info` of the same files computed (an export folder's only)
    with user_errors():
        if (out is None) == (config_path is None):
            raise InvalidArgumentError("give an export folder OUT or --config CONFIG.json (one of them)")
        if config_path is None:
            extra = [name for name in CONFIG_ONLY if given[name] is not None]
            if extra:
                flag = "--" + extra[0].replace("_", "-")
                raise InvalidArgumentError(f"{flag} describes the export a --config is modelled as; an export "
                                           "folder records its own: drop it")
            out = locate(out, revision, "export")
            if not (out / "manifest.json").exists() and (out / "config.json").is_file():
                raise InvalidArgumentError(f"{out} is not a llama-ane export (manifest.json is missing) but a "
                                           f"checkpoint folder: model the export it would make with "
                                           f"`llama-ane info --config {out}`, or export it first")
            known = Remembered.load()
            m = checked_manifest(out, known)
            known.save()
        else:
            options = {k: v for k, v in given.items() if v is not None}
            m = manifest_from_config(read_config(locate(config_path, revision, "config")), **options)
        chips = [find_chip(chip)] if chip is not None else list(CHIPS.values())
        n = m["context_length"] - 1 if filled is None else filled
        model = report(m, n, chips, prompt_length=prompt_length, branches=branches)
    traffic = decode_step_traffic(m, filled=n)
    wired = resident(m)
    if as_json:
        other = "inputs" if kv_cache_kind(m) == "state" else "state"
        extra = {"decode_step_bytes": {**traffic.to_dict(), **model}, "resident_bytes": wired.bytes,
                 "weight_copy_bytes": wired.weight_copy_bytes, "resident": wired.to_dict()}
        if not m["config"].get("kv_shared_layers"):  # no states (see _traffic)
            extra["decode_step_bytes_other_kv_cache"] = {"kv_cache": other,
                                                         **decode_step_traffic(m, other, filled=n).to_dict()}
        if bandwidth is not None:
            extra["bandwidth_bound_tokens_per_s"] = traffic.tokens_per_s_bound(bandwidth)
        click.echo(json.dumps({**m, **extra}, indent=2))
        return
    _describe(m, config_path)
    _functions(m, out, known)
    if known is not None:
        known.save()
    _resident(wired)
    _traffic(m, traffic, n, bandwidth)
    _modelled(model, prompt_length, branches)
    if config_path is None:
        size = sum(f.stat().st_size for name in m["files"] for f in ([out / name] if (out / name).is_file()
                                                                       else (out / name).rglob("*")) if f.is_file())
        click.echo(f"  files     {len(m['files'])}, {size / 1e6:.1f} MB, sha256 verified")


def _describe(m: dict, config_path: str | None) -> None:
    from ..contract.manifest import window_cascade

    c = m["config"]
    if config_path is None:
        click.echo(f"{m['name']}  (format {m['format_version']}, made by llama_ane "
                   f"{m['created_by'].get('llama_ane')})")
    else:
        click.echo(f"{config_path}  (not exported: the export these options would make, modelled)")
    wide = (f" (global layers {c['num_attention_heads']}/{c.get('global_key_value_heads') or c['num_key_value_heads']}"
            f" x {c.get('global_head_dim') or c['head_dim']})" if c.get("global_head_dim") or c.get("global_key_value_heads")
            else "")
    shared = f", the last {c['kv_shared_layers']} KV-shared" if c.get("kv_shared_layers") else ""
    click.echo(f"  model     {c['num_hidden_layers']} layers, hidden {c['hidden_size']}, heads "
               f"{c['num_attention_heads']}/{c['num_key_value_heads']} x {c['head_dim']}{wide}{shared}, "
               f"vocab {c['vocab_size']}")
    click.echo(f"  context   {m['context_length']} tokens, prefill window {m['prefill_length']}, "
               f"{m['precision']}, target {m['deployment_target']}, "
               f"{'multifunction' if m['multifunction'] else 'single-function'} packages")
    if m.get("branch_width") and window_cascade(m):
        click.echo(f"  cascade   up to {m['branch_width']} branches per step as rows of the prefill window, their "
                   "tokens side by side in the context after the prefix")
    elif m.get("branch_width"):
        click.echo(f"  cascade   {m['branch_width']} branches per step, {m['suffix_length']} suffix tokens each")
    if m.get("verify_window"):
        click.echo(f"  verify    token trees of {m['verify_window']} tokens per step (speculative decoding)")
    from ..contract.traffic import per_layer_table, ring_bytes, state_bytes

    if m["cache"].get("sliding"):

        ring = m["cache"]["sliding"]
        click.echo(f"  sliding   layers {ring['layers']} keep a ring of {ring['length']} positions (window "
                   f"{c['sliding_window']}): {ring_bytes(m) / 1e6:.2f} MB of K/V, whatever the context")
    if m["cache"].get("delta"):
        delta, (conv, recurrent) = m["cache"]["delta"], state_bytes(m)
        click.echo(f"  linear    layers {delta['layers']} (Gated DeltaNet, {c['delta_key_heads']} key / "
                   f"{delta['heads']} value heads) keep a recurrent state of {delta['heads']} x {delta['key_dim']} x "
                   f"{delta['value_dim']} each: {recurrent / 1e6:.2f} MB, with the conv states' {conv / 1e6:.2f} MB, "
                   "whatever the context")
    weights = m.get("weights", {})

    def mb(model: str) -> str:
        w = weights.get(model)
        if not w:
            return ""
        dense = f" ({w['dense_bytes'] / 1e6:.1f} MB dense)" if w["dense_bytes"] != w["bytes"] else ""
        return f", {w['bytes'] / 1e6:.1f} MB{dense}"
    table = per_layer_table(m)
    for model, (a, b) in zip(m["embeddings"]["models"], m["embeddings"]["vocab_ranges"]):
        rows = table.rows.get(model) if table else None
        per_layer = f", per-layer rows {rows[0]}..{rows[1] - 1}" if rows else ""
        click.echo(f"  {model:<12} token rows {a}..{b - 1}{per_layer}{mb(model)}")
    if table:
        files = list(table.rows)
        where = files[0] if len(files) == 1 else f"{files[0]}..{files[-1]} ({len(files)} files)"
        click.echo(f"  per-layer table {table.vocab} x {table.channels} ({c['num_hidden_layers']} layers x "
                   f"{c['per_layer_input_size']}) in {where}, {table.table_bytes / 1e6:.1f} MB; projection "
                   f"{c['hidden_size']} -> {table.channels} in {table.projection_model}, "
                   f"{table.projection_bytes / 1e6:.1f} MB; a token reads {len(files)} row(s) and the projection, "
                   f"{table.step_bytes / 1e6:.2f} MB")
    for chunk in m["chunks"]:
        click.echo(f"  {chunk['model']:<12} layers {chunk['layers'][0]}..{chunk['layers'][-1]}{mb(chunk['model'])}")
    for model in m["lm_head"]["models"]:
        splits = [o["shape"][1] for o in next(iter(m["models"][model]["functions"].values()))["outputs"]]
        click.echo(f"  {model:<12} vocab splits {splits}{mb(model)}")
    if m["lm_head"].get("folded_into"):
        click.echo(f"  {'lm_head':<12} computed in {m['lm_head']['folded_into']} (vocab splits "
                   f"{m['lm_head']['vocab_splits']}): no call of its own")
    from ..quantize.auto import device_paths, recipe_forms, recipe_label

    quantization = m.get("quantization", {})
    paths = device_paths(quantization)  # each form with how the Neural Engine runs it
    if any(p != "fp16" for p in paths.values()):
        click.echo("  weights   " + "; ".join(f"{part} {p}" for part, p in paths.items()))
    forms = recipe_forms(quantization)
    if forms:
        click.echo(f"  recipe    {recipe_label(forms)}")
    if any(d.get("scheme", "").startswith("lut") or "lut" in str(d.get("units", "")) for d in quantization.values()
           if isinstance(d, dict)):
        from ..contract.device_model import CHIPS

        known = "; ".join(f"{c.name} {c.luts}" for c in CHIPS.values() if c.luts)
        click.echo(f"  luts      {known}; no published figure for the other chips")
    recipe = quantization.get("recipe", {})
    if recipe.get("measured_pct") is not None:
        click.echo(f"  quality   perplexity {recipe['measured_pct']:+.2f}% against fp16 (measured on "
                   f"{recipe.get('measured_on', 'held-out text')}; --quantize auto budget {recipe.get('budget_pct')}%)")


def _traffic(m: dict, t, filled: int, bandwidth: float | None) -> None:
    from ..contract.manifest import kv_cache_kind
    from ..contract.traffic import decode_step_traffic

    compressed = t.weights != t.weights_dense
    stateful = kv_cache_kind(m) == "state"
    written = "state write" if stateful else "cache update"
    how = "one column per state" if stateful else "read and written"
    if m["cache"].get("delta"):  # written whole with either kind
        how += ", the recurrent states whole"
    click.echo(f"  decode    {t.total / 1e6:.1f} MB per token at {filled} filled positions (modelled from the "
               f"manifest): weights {t.weights / 1e6:.1f} MB"
               + (f" as stored ({t.weights_dense / 1e6:.1f} MB decompressed)" if compressed else "")
               + f", KV cache read {t.cache_read / 1e6:.1f} MB, {written} {t.cache_update / 1e6:.1f} MB ({how})")
    other = "inputs" if stateful else "state"
    if m["config"].get("kv_shared_layers"):  # the planner refuses states: a chunk's state cannot feed another chunk
        click.echo("  kv cache  inputs + cache-update model (KV-shared layers read other chunks' caches: no "
                   "--kv-cache state)")
    else:
        o = decode_step_traffic(m, other, filled=filled)
        click.echo(f"  kv cache  {'Core ML states' if stateful else 'inputs + cache-update model'}; with --kv-cache "
                   f"{other}: {o.total / 1e6:.1f} MB per token ({'cache update' if stateful else 'state write'} "
                   f"{o.cache_update / 1e6:.1f} MB)")
    if bandwidth is not None:
        bound = f"{t.tokens_per_s_bound(bandwidth):.1f}"
        if compressed:
            bound += f" ({t.tokens_per_s_bound(bandwidth, dense=True):.1f} if decompressed at load)"
        click.echo(f"  bound     at {bandwidth:g} GB/s: at most {bound} tokens/s (upper bound from bytes per token, "
                   "not a measurement)")


def _modelled(model: dict, prompt_length: int | None, branches: int | None) -> None:
    """The per-chip table: decode tokens/s (and the range the chip's figures span), and the time to
    first token, cascade tokens/s and verify break-even where asked or exported."""
    click.echo(f"  calls     {model['calls_per_token']} Core ML calls per decode token; cache read up to "
               f"{model['attended_positions']} positions")
    columns = []  # (title, key in the chip's row, format)
    if any("tokens_per_s_dense" in row for row in model["chips"].values()):
        columns.append(("decompressed tok/s", "tokens_per_s_dense", "{:.1f}"))
    if prompt_length is not None:
        columns.append((f"TTFT ms (P={prompt_length})", "ttft_ms", "{:.0f}"))
    if branches is not None:
        columns.append((f"cascade tok/s (B={branches})", "cascade_tokens_per_s", "{:.1f}"))
    if "verify" in model:
        columns.append(("verify break-even", "verify_break_even_tokens", "{:.2f} tokens"))
    click.echo(f"  {'chip':<9} {'GB/s':>9} {'ms/call':>10}  {'decode tok/s (range)':<22}"
               + "".join(f" {title:>{len(title)}}" for title, _, _ in columns))
    for name, row in model["chips"].items():
        (b0, b1), (c0, c1) = row["bandwidth_gb_s"], row["per_call_ms"]
        lo, hi = row["tokens_per_s_range"]
        rate = f"{row['tokens_per_s']:.1f} ({lo:.1f}-{hi:.1f})"
        click.echo(f"  {name:<9} {_span(b0, b1, '{:g}'):>9} {_span(c0, c1, '{:.2f}'):>10}  {rate:<22}"
                   + "".join(f" {fmt.format(row[key]):>{len(title)}}" for title, key, fmt in columns))
    click.echo("  (modelled: time = max(bytes / ANE streaming bandwidth, flops / fp16 peak) + calls x per-call cost, "
               "from published or assumed chip figures, not measured; see docs/device-model.md)")


def _resident(wired) -> None:
    """Resident memory of the functions a runtime holds to serve every phase, and their first load."""
    low, high = wired.range
    click.echo(f"  resident  {wired.runtime} holding its {wired.functions} functions wires {wired.bytes / 1e6:.0f} MB "
               f"({low / 1e6:.0f}-{high / 1e6:.0f}), {wired.copies:.2f}x one loaded copy of the weights "
               f"({wired.weight_copy_bytes / 1e6:.0f} MB); first load ~{wired.first_load_s:.0f} s of "
               "specialization")
    click.echo("            (modelled: " + ("each function loaded for the Neural Engine wires its own copy of its "
                                            "package's weights" if wired.runtime == "Core ML" else
                                            "its entry points share one copy of the weights")
               + ", as measured on M6; first load scaled by function count from an M4 Max; docs/device-model.md)")


def _span(lo: float, hi: float, fmt: str) -> str:
    return fmt.format(lo) if lo == hi else f"{fmt.format(lo)}-{fmt.format(hi)}"


def _functions(m: dict, out: Path | None, known: "Remembered | None") -> None:
    """Per package, the functions it holds and, for an export folder, the bytes each adds: its own
    constants in the weight blob (those no other function of the package shares), remembered in
    `known` from an earlier look at the same package. A modelled export (--config) has no packages
    to read: it shows the functions only."""
    from ..limits import MAX_FUNCTIONS_PER_PACKAGE

    files: dict[str, list[str]] = {}
    for model, entry in m["models"].items():
        for fn, spec in entry["functions"].items():
            files.setdefault(spec.get("file") or f"{model}.mlpackage", []).append(spec.get("function_name") or fn)
    click.echo(f"  functions per package (at most {MAX_FUNCTIONS_PER_PACKAGE} in a package of weights)"
               + ("; bytes each adds beyond the shared weights" if out is not None
                  and any(file.endswith(".mlpackage") for file in files) else ""))
    for file, functions in files.items():
        own = {}
        if out is not None and known is not None and file.endswith(".mlpackage"):  # a Core AI asset: not read
            own = known.get(out / file, "function_bytes", function_bytes)
        listed = ", ".join(f"{fn} +{own[fn] / 1e3:.1f} kB" if fn in own else fn for fn in functions)
        click.echo(f"    {file:<28} {len(functions):>2}: {listed}")


def function_bytes(package: Path) -> dict[str, int]:
    """{function: bytes of the weight-blob constants only it uses} of a saved package: what a
    function adds beyond the weights its package's functions share (a multifunction package keeps
    one copy of a shared weight). Each blob entry's size is read from its header."""
    import struct

    from ..mil.package import MilPackage

    pkg = MilPackage(package)
    users: dict[tuple[str, int], set[str]] = {}
    for fn in pkg.function_names:
        for location in pkg.blob_locations(fn).values():
            users.setdefault(location, set()).add(fn)
        for _, sources in pkg.constexpr_sources(fn).values():
            for source in sources:
                if len(source) == 3:  # (input, blob file, offset); chained sources are counted where they are
                    users.setdefault((source[1], source[2]), set()).add(fn)
    own = dict.fromkeys(pkg.function_names, 0)
    for (blob, offset), fns in users.items():
        if len(fns) == 1:
            with open(pkg.weights_dir / blob, "rb") as f:
                f.seek(offset + 8)  # the entry's header: sentinel, dtype, then its size in bytes
                own[next(iter(fns))] += struct.unpack("<Q", f.read(8))[0]
    return own


class Remembered:
    """What `info` computed about an export's files, kept between runs in the user's cache folder
    (`info.json` in platformdirs' user_cache_dir("llama-ane"), e.g. ~/.cache/llama-ane on Linux):
    each file's or package's sha256 and the bytes each function of a package adds. An entry is
    keyed by the file's absolute path and holds the signature it was computed for (each file's
    size, inode, modification and change times: a write changes the change time, which cannot be
    set back), so a file that changed in any way is read again. Nothing is written into the
    export folder. At most MAX_ENTRIES paths are kept, the most recently used."""

    MAX_ENTRIES = 512
    FILE = "info.json"

    def __init__(self, path: Path | None, entries: dict):
        self.path, self.entries, self.changed = path, entries, False

    @classmethod
    def load(cls) -> "Remembered":
        try:
            from platformdirs import user_cache_dir

            path = Path(user_cache_dir("llama-ane")) / cls.FILE
        except Exception:  # no home folder to find a cache folder in: remember nothing
            return cls(None, {})
        try:
            entries = json.loads(path.read_text(encoding="utf-8"))
            if not isinstance(entries, dict):
                entries = {}
        except (OSError, ValueError):  # none yet, unreadable or not JSON: start again
            entries = {}
        return cls(path, entries)

    def get(self, path: Path, key: str, compute):
        """`key` of `path` as remembered for the path's current state, else compute(path), remembered."""
        from ..contract.manifest import _signature

        def sign() -> list:
            return json.loads(json.dumps(_signature(Path(path))))  # as it reads back from the file

        name, signature = str(Path(path).resolve()), sign()
        entry = self.entries.pop(name, None)
        if not isinstance(entry, dict) or entry.get("signature") != signature:
            entry = {"signature": signature}
            self.changed = True
        if key not in entry:
            value = compute(Path(path))
            after = sign()
            if after != signature:  # computing it wrote the files (coremltools rewrites a package's Manifest.json)
                entry = {"signature": after}
            entry[key] = value
            self.changed = True
        self.entries[name] = entry  # the most recently used last
        return entry[key]

    def save(self) -> None:
        """Write what changed (best effort: a cache folder that cannot be written is skipped)."""
        if self.path is None or not self.changed:
            return
        import os
        import tempfile

        keep = dict(list(self.entries.items())[-self.MAX_ENTRIES:])
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".info-", suffix=".json", dir=self.path.parent)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(keep, f)
            os.replace(tmp, self.path)
        except OSError:
            return
        self.changed = False


def checked_manifest(out: Path, known: Remembered) -> dict:
    """OUT's manifest, read and checked as `read_manifest` does, each file's sha256 computed only if
    `known` does not remember it for the file as it is now. A file whose sha256 does not match is
    refused as read_manifest refuses it."""
    from ..contract.manifest import read_manifest, sha256_path

    m = read_manifest(out, check_hashes=False)
    if any(known.get(out / name, "sha256", sha256_path) != digest for name, digest in m["files"].items()):
        read_manifest(out)  # raises naming the file
    return m
