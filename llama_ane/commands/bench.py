"""`llama-ane bench`: measure an export where it runs (TTFT, prefill and decode tokens/s per filled
length and context bucket, cascade steps, Core ML calls per token, peak memory), beside the device
cost model's numbers for a chip, and write the result as JSON to share.

    llama-ane bench OUT                                     on a Mac: Core ML, the Mac's own chip modelled
    llama-ane bench OUT --prompt-lengths 128,512 --filled 0,500,1000 --json bench.json
    llama-ane bench OUT --backend torch --chip M4           elsewhere: labelled, not device numbers
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
from pathlib import Path

import click

from ..errors import InvalidArgumentError
from .errors import user_errors
from .options import BACKEND, OptionError, PathOrRepo, flag_of, revision_option


class IntList(click.ParamType):
    """Comma-separated whole numbers ("128,512"), refused by flag when any is not one."""

    name = "N[,N...]"

    def convert(self, value, param, ctx) -> tuple[int, ...]:
        if isinstance(value, tuple):
            return value
        parts = [p.strip() for p in str(value).split(",")]
        try:
            return tuple(int(p) for p in parts)
        except ValueError:
            raise OptionError(f"{flag_of(param)} must be whole numbers separated by commas (e.g. 128,512), "
                              f"got {value!r}") from None


@click.command("bench")
@click.argument("out", type=PathOrRepo())
@revision_option("OUT")
@click.option("--backend", type=BACKEND, default="auto", show_default=True,
              help="auto = coreml on macOS (device numbers), torch elsewhere (labelled: not device numbers).")
@click.option("--prompt-lengths", type=IntList(), default=None, metavar="P[,P...]",
              help="Prompt lengths whose time to first token and prefill tokens/s are measured "
                   "[default: 128, or the context if shorter].")
@click.option("--filled", type=IntList(), default=None, metavar="N[,N...]",
              help="Cached positions before the measured decode steps (and the prefix of the cascade steps) "
                   "[default: 0, each context bucket's first position, the context less one].")
@click.option("--branches", type=int, default=None, metavar="B",
              help="Cascade branches per measured step, over each --filled prefix [default: the export's width; "
                   "none without a cascade function]; 0: no cascade steps.")
@click.option("--repeats", type=int, default=5, show_default=True, help="Timed samples per measurement (the median).")
@click.option("--warmup", type=int, default=1, show_default=True,
              help="Untimed-in-the-median warm-up samples per measurement (reported apart).")
@click.option("--chip", default=None, metavar="NAME",
              help="Put this chip's modelled numbers beside the measured ones (M1, M4 Max, A18 Pro, ...) "
                   "[default: on a Mac its own chip, where the model knows it; elsewhere none].")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=None, metavar="FILE",
              help="Write the whole result (machine, versions, export, every sample, the modelled numbers) to FILE.")
@click.option("--force", is_flag=True, help="Overwrite an existing --json FILE.")
def command(out, revision, backend, prompt_lengths, filled, branches, repeats, warmup, chip, json_path, force):
    """Measure the export in OUT (a folder or a Hugging Face repo id) and compare it with the device
    cost model."""
    from ..contract.device_model import chip as find_chip
    from ..hub import locate
    from ..runtime.bench import BenchOptions, run_bench

    options = BenchOptions(prompt_lengths or (), filled or (), branches, repeats, warmup)
    with user_errors():
        options.check()
        if chip is not None:
            find_chip(chip)
        if json_path is not None:
            if json_path.exists() and not force:
                raise InvalidArgumentError(f"--json {json_path} exists; choose another file or pass --force to "
                                           "overwrite it")
            if not json_path.parent.is_dir():
                raise InvalidArgumentError(f"--json {json_path}: the folder {json_path.parent} does not exist")
        out = locate(out, revision, "export")
        if not (out / "manifest.json").is_file():
            raise InvalidArgumentError(f"{out} is not a llama-ane export (no manifest.json); export one first with "
                                       "`llama-ane export`")
        result = run_bench(out, backend, options, chip, log=lambda m: click.echo(f"  ... {m}", err=True))
    _print(result)
    if json_path is not None:
        with user_errors():
            _write_json(json_path, result)
        click.echo(f"wrote {json_path}")


def _write_json(path: Path, result: dict) -> None:
    """Write `result` whole or not at all: under a temporary name beside `path`, then renamed."""
    partial = path.with_name(f".{path.name}.{secrets.token_hex(4)}.partial")
    try:
        with open(partial, "x") as f:
            json.dump(result, f, indent=2)
            f.write("\n")
        os.replace(partial, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.unlink(partial)
        raise InvalidArgumentError(f"--json {path}: cannot write it ({e.strerror or e}); choose another file") from None


def _vs(modelled: dict | None, key: str, fmt: str, name: str | None) -> str:
    if modelled is None:
        return ""
    return f"   modelled {name}: {fmt.format(modelled[key])}"


def _print(r: dict) -> None:
    e, m = r["export"], r["machine"]
    chip = r["chip"]["name"] if r["chip"] else None
    click.echo(f"{e['name']}: {r['backend']} backend on {m['cpu']} ({m['os']}, {m['memory_bytes'] / 2**30:.0f} GiB)")
    click.echo(r["label"])
    n, w = r["options"]["repeats"], r["options"]["warmup"]
    click.echo(f"  load      {r['load_s']:.2f} s; each number the median of {n} timed sample{'s' * (n != 1)}, "
               f"after {w} warm-up sample{'s' * (w != 1)}")
    for p in r["prefill"]:
        warm = p["timings"]["warmup_s"]
        click.echo(f"  prefill   P={p['prompt_length']}: TTFT {p['ttft_ms']:.1f} ms, {p['tokens_per_s']:.1f} tok/s, "
                   f"{p['calls']:g} calls" + (f" (warm-up {warm[0] * 1e3:.1f} ms)" if warm else "")
                   + _vs(p["modelled"], "ttft_ms", "TTFT {:.1f} ms", chip))
    for d in r["decode"]:
        click.echo(f"  decode    filled {d['filled']} (bucket {d['bucket']}): {d['tokens_per_s']:.1f} tok/s, "
                   f"{d['calls_per_token']:g} calls/token" + _vs(d["modelled"], "tokens_per_s", "{:.1f} tok/s", chip))
    for c in r["cascade"]:
        click.echo(f"  cascade   B={c['branches']} over {c['prefix']}: {c['tokens_per_s']:.1f} tok/s, "
                   f"{c['calls_per_step']:g} calls/step" + _vs(c["modelled"], "tokens_per_s", "{:.1f} tok/s", chip))
    mem = r["memory"]
    click.echo(f"  memory    peak {mem['peak_bytes'] / 1e6:.1f} MB {mem['kind'].upper()} (after load "
               f"{mem['after_load_bytes'] / 1e6:.1f} MB)")
    plan = r["compute_plan"]
    if plan is not None and "unavailable" in plan:
        click.echo(f"  plan      Core ML gave no compute plan ({plan['unavailable']})")
    elif plan is not None and plan["ane_op_share"] is not None:
        ops = plan["ops"]
        click.echo(f"  plan      {plan['ane_op_share']:.1%} of ops on the Neural Engine (ANE {ops['ANE']}, "
                   f"GPU {ops['GPU']}, CPU {ops['CPU']})")
    if chip:
        click.echo(f"  (modelled numbers for {chip} ({r['chip']['source']}): {r['modelled']}; see docs/device-model.md)")
