"""`llama-ane info`: what an export folder holds, from its manifest."""

from __future__ import annotations

import json
from pathlib import Path

import click

from .errors import user_errors


@click.command("info")
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the manifest as JSON.")
def command(out, as_json):
    """Describe the export in OUT (the hashes are checked)."""
    from ..export.manifest import read_manifest

    with user_errors():
        m = read_manifest(out)
    if as_json:
        click.echo(json.dumps(m, indent=2))
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
    for chunk in m["chunks"]:
        click.echo(f"  {chunk['model']:<10} layers {chunk['layers'][0]}..{chunk['layers'][-1]}")
    click.echo(f"  lm head   vocab split {m['lm_head']['vocab_splits']}")
    size = sum(f.stat().st_size for name in m["files"] for f in ([out / name] if (out / name).is_file()
                                                                   else (out / name).rglob("*")) if f.is_file())
    click.echo(f"  files     {len(m['files'])}, {size / 1e6:.1f} MB, sha256 verified")
