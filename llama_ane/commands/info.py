"""`llama-ane info`: what an export folder holds, from its manifest."""

from __future__ import annotations

import json
from pathlib import Path

import click

from ..errors import InvalidArgumentError
from .errors import user_errors
from .options import FiniteFloat


@click.command("info")
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--bandwidth", type=FiniteFloat(minimum=0, min_open=True, unit="GB/s"), default=None, metavar="GB/S",
              help="Memory bandwidth of a device: adds the decode tokens/s that bandwidth bounds (an upper "
                   "bound, not a measurement).")
@click.option("--json", "as_json", is_flag=True, help="Print the manifest, with the decode step's traffic, as JSON.")
def command(out, bandwidth, as_json):
    """Describe the export in OUT (the hashes are checked): its models, weights and the bytes one
    decode step reads."""
    from ..contract.manifest import kv_cache_kind, read_manifest
    from ..contract.traffic import decode_step_traffic

    with user_errors():
        m = read_manifest(out)
        if bandwidth is not None and bandwidth <= 0:
            raise InvalidArgumentError(f"--bandwidth must be a positive number of GB/s, got {bandwidth}")
    traffic = decode_step_traffic(m)
    if as_json:
        other = "inputs" if kv_cache_kind(m) == "state" else "state"
        extra = {"decode_step_bytes": traffic.to_dict(),
                 "decode_step_bytes_other_kv_cache": {"kv_cache": other,
                                                      **decode_step_traffic(m, other).to_dict()}}
        if bandwidth is not None:
            extra["bandwidth_bound_tokens_per_s"] = traffic.tokens_per_s_bound(bandwidth)
        click.echo(json.dumps({**m, **extra}, indent=2))
        return
    c = m["config"]
    click.echo(f"{m['name']}  (format {m['format_version']}, made by llama_ane {m['created_by'].get('llama_ane')})")
    click.echo(f"  model     {c['num_hidden_layers']} layers, hidden {c['hidden_size']}, heads "
               f"{c['num_attention_heads']}/{c['num_key_value_heads']} x {c['head_dim']}, vocab {c['vocab_size']}")
    click.echo(f"  context   {m['context_length']} tokens, prefill window {m['prefill_length']}, "
               f"{m['precision']}, target {m['deployment_target']}, "
               f"{'multifunction' if m['multifunction'] else 'single-function'} packages")
    if m.get("branch_width"):
        click.echo(f"  cascade   {m['branch_width']} branches per step, {m['suffix_length']} suffix tokens each")
    if m.get("verify_window"):
        click.echo(f"  verify    token trees of {m['verify_window']} tokens per step (speculative decoding)")
    weights = m.get("weights", {})

    def mb(model: str) -> str:
        w = weights.get(model)
        if not w:
            return ""
        dense = f" ({w['dense_bytes'] / 1e6:.1f} MB dense)" if w["dense_bytes"] != w["bytes"] else ""
        return f", {w['bytes'] / 1e6:.1f} MB{dense}"
    for model, (a, b) in zip(m["embeddings"]["models"], m["embeddings"]["vocab_ranges"]):
        click.echo(f"  {model:<12} token rows {a}..{b - 1}{mb(model)}")
    for chunk in m["chunks"]:
        click.echo(f"  {chunk['model']:<12} layers {chunk['layers'][0]}..{chunk['layers'][-1]}{mb(chunk['model'])}")
    for model in m["lm_head"]["models"]:
        splits = [o["shape"][1] for o in m["models"][model]["functions"]["decode"]["outputs"]]
        click.echo(f"  {model:<12} vocab splits {splits}{mb(model)}")
    schemes = {part: d["scheme"] for part, d in m.get("quantization", {}).items()}
    if any(s != "none" for s in schemes.values()):
        click.echo("  weights   " + ", ".join(f"{part} {scheme}" for part, scheme in schemes.items()))
    t = traffic
    compressed = t.weights != t.weights_dense
    stateful = kv_cache_kind(m) == "state"
    written = "state write" if stateful else "cache update"
    how = "one column per state" if stateful else "read and written"
    click.echo(f"  decode    {t.total / 1e6:.1f} MB per token (modelled from the manifest): weights "
               f"{t.weights / 1e6:.1f} MB"
               + (f" as stored ({t.weights_dense / 1e6:.1f} MB decompressed)" if compressed else "")
               + f", KV cache read {t.cache_read / 1e6:.1f} MB, {written} {t.cache_update / 1e6:.1f} MB ({how})")
    other = "inputs" if stateful else "state"
    o = decode_step_traffic(m, other)
    click.echo(f"  kv cache  {'Core ML states' if stateful else 'inputs + cache-update model'}; with --kv-cache "
               f"{other}: {o.total / 1e6:.1f} MB per token ({'cache update' if stateful else 'state write'} "
               f"{o.cache_update / 1e6:.1f} MB)")
    if bandwidth is not None:
        bound = f"{t.tokens_per_s_bound(bandwidth):.1f}"
        if compressed:
            bound += f" ({t.tokens_per_s_bound(bandwidth, dense=True):.1f} if decompressed at load)"
        click.echo(f"  bound     at {bandwidth:g} GB/s: at most {bound} tokens/s (upper bound from bytes per token, "
                   "not a measurement)")
    size = sum(f.stat().st_size for name in m["files"] for f in ([out / name] if (out / name).is_file()
                                                                   else (out / name).rglob("*")) if f.is_file())
    click.echo(f"  files     {len(m['files'])}, {size / 1e6:.1f} MB, sha256 verified")
