"""Write benchmarks/README.md from the committed results, benchmarks/results/*.json.

One table per results file. Every row carries the date, machine and commit its file records (the
row's own fields first, then the file's); where the file records none of them the cell says
"unknown". Nothing here measures anything: rerun a benchmark script to refresh its file, then
this script.

    python benchmarks/report.py            # or: make bench-report
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Callable, Iterable

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
UNKNOWN = "unknown"

Row = tuple[list[dict], list[object]]  # (dicts to read the stamps from, most specific first; cells)


def _num(x: object, digits: int = 2) -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)


def _first(sources: Iterable[dict], *keys: str) -> object:
    for src in sources:
        for key in keys:
            if isinstance(src, dict) and src.get(key) not in (None, ""):
                return src[key]
    return None


def _machine(value: object) -> str:
    if isinstance(value, dict):
        parts = []
        if "cpu_count" in value:
            parts.append(f"{value['cpu_count']} CPUs")
        if "mem_total_gib" in value:
            parts.append(f"{value['mem_total_gib']} GiB")
        return ", ".join(parts) or UNKNOWN
    return str(value)


def stamps(sources: list[dict]) -> list[str]:
    """Date, machine and commit from the first source that records each, else "unknown"."""
    date = _first(sources, "date", "timestamp")
    machine = _first(sources, "device", "machine")
    processor = _first(sources, "processor")
    commit = _first(sources, "commit")
    machine_text = _machine(machine) if machine is not None else UNKNOWN
    if processor and isinstance(machine, str) and processor not in machine_text:
        machine_text += f" {processor}"
    return [str(date)[:10] if date else UNKNOWN, machine_text, str(commit) if commit else UNKNOWN]


# --- one renderer per results file: (header, rows) --------------------------------------------

def branches_cpu(d: dict) -> tuple[list[str], list[Row]]:
    header = ["branches", "prefix tokens", "tokens / branch", "cascade tok/s", "sequential tok/s",
              "speedup", "identical tokens"]
    return header, [([r, d.get("meta", {})],
                     [r["branches"], r["prefix_tokens"], r["new_tokens_per_branch"],
                      _num(r["cascade_tok_per_s"]), _num(r["sequential_tok_per_s"]),
                      _num(r["speedup"]) + "x", _num(r["identical_tokens"])]) for r in d["rows"]]


def cpu_runtime(d: dict) -> tuple[list[str], list[Row]]:
    header = ["prompt", "new tokens", "threads", "prefill tok/s (ours / transformers)",
              "decode tok/s (ours / transformers)", "prefill", "decode", "same greedy tokens"]
    ours, hf = d["llama_ane"], d["transformers"]
    return header, [([d.get("meta", {}), d],
                     [d["prompt_tokens"], d["new_tokens"], d["threads"],
                      f"{_num(ours['prefill_tok_s'], 1)} / {_num(hf['prefill_tok_s'], 1)}",
                      f"{_num(ours['decode_tok_s'], 1)} / {_num(hf['decode_tok_s'], 1)}",
                      _num(d["prefill_ratio"]) + "x", _num(d["decode_ratio"]) + "x",
                      d["same_greedy_tokens"]])]


def cuda_cascade(d: dict) -> tuple[list[str], list[Row]]:
    header = ["prefix", "batch", "suffix", "heads", "auto ms (path)", "ours cascade",
              "ours decode", "FlashInfer cascade", "FlashInfer decode", "vs best FlashInfer",
              "roofline"]
    rows = [([p, d], [p["prefix"], p["batch"], p["suffix"], f"{p['hq']}/{p['hkv']}",
                      f"{_num(p['ours_auto_ms'], 3)} ({p['auto_path']})",
                      _num(p["ours_cascade_ms"], 3), _num(p["ours_decode_ms"], 3),
                      _num(p["fi_cascade_ms"], 3), _num(p["fi_decode_ms"], 3),
                      _num(p["auto_vs_fi_best"]) + "x", f"{p['roofline_frac']:.0%}"])
            for p in d["points"]]
    return header, rows


def cuda_decode_bandwidth(d: dict) -> tuple[list[str], list[Row]]:
    header = ["heads", "batch x tokens", "ours ms", "ours % of HBM peak", "FlashInfer ms",
              "FlashInfer %"]
    return header, [([r, d], [f"{r['hq']}/{r['hkv']}", f"{r['batch']} x {r['length']}",
                              _num(r["ours_ms"], 3), f"{r['bw_frac']:.1%}", _num(r["fi_ms"], 3),
                              f"{r['fi_bw_frac']:.1%}"]) for r in d["decode_bandwidth"]]


def cuda_tree(d: dict) -> tuple[list[str], list[Row]]:
    header = ["workload", "heads", "queries", "per-branch decode ms", "cascade ms", "tree ms",
              "vs per-branch", "vs cascade", "auto ms (path)"]
    return header, [([r, d], [r["workload"], f"{r['hq']}/{r['hkv']}", r["queries"],
                              _num(r["per_branch_ms"], 4), _num(r["cascade_ms"], 4),
                              _num(r["tree_ms"], 4), _num(r["speedup_vs_per_branch"]) + "x",
                              _num(r["speedup_vs_cascade"]) + "x",
                              f"{_num(r['auto_ms'], 4)} ({r['auto_path']})"])
                    for r in d["rows"]]


def cuda_engine(d: dict) -> tuple[list[str], list[Row]]:
    header = ["branches", "prompt", "new tokens", "transformers tok/s", "CUDA graph tok/s",
              "eager tok/s", "graph vs transformers", "branches with transformers' tokens"]
    return header, [([r, d], [r["branches"], r["prompt_len"], r["new_tokens"],
                              _num(r["hf_tokens_per_s"], 0), _num(r["ours_graph_tokens_per_s"], 0),
                              _num(r["ours_eager_tokens_per_s"], 0), _num(r["graph_vs_hf"]) + "x",
                              f"{r['ours_graph_same_tokens_as_hf']}/{r['branches']}"])
                    for r in d["rows"]]


def export_scale(d: dict) -> tuple[list[str], list[Row]]:
    header = ["run", "command", "wall s", "cpu s", "load (1 min)", "peak memory GiB", "packages GB", "verify",
              "inspect --strict", "new/reference wall, peak", "temp leftovers"]
    rows = []
    for label, e in d.items():
        new = e.get("new", {})
        left = new.get("tmp_leftovers", {}).get("names")
        load = new.get("load_average")
        inspect = e.get("inspect")
        ratios = e.get("ratios")
        rows.append(([e], [label, f"`{e.get('command', '')}`", _num(new.get("wall_s"), 1), _num(new.get("cpu_s"), 1),
                           "-" if not load else "{:.1f}-{:.1f}".format(*load),
                           _num(new.get("peak_pss_gib")),
                           _num(new["total_bytes"] / 1e9) if "total_bytes" in new else "-",
                           new.get("verify", "-"),
                           "-" if not inspect else "clean" if inspect["exit_code"] == 0 else "violations",
                           "-" if not ratios else f"{ratios['wall']:.2f}x, {ratios['peak']:.2f}x",
                           ", ".join(left) if left else "none"]))
    return header, rows


def long_context(d: dict) -> tuple[list[str], list[Row]]:
    header = ["prompt tokens", "direct: prefill tok/s", "direct: ms / decode step",
              "cache-update modules: prefill tok/s", "cache-update modules: ms / decode step",
              "same greedy tokens"]
    return header, [([r, d.get("meta", {})],
                     [r["prompt_tokens"], _num(r["direct"]["prefill_tok_s"], 1),
                      _num(r["direct"]["decode_ms_per_step"], 1),
                      _num(r["cache_update_modules"]["prefill_tok_s"], 1),
                      _num(r["cache_update_modules"]["decode_ms_per_step"], 1),
                      _num(r["same_greedy_tokens"])]) for r in d["rows"]]


def serve(d: dict) -> tuple[list[str], list[Row]]:
    header = ["model", "batching", "prompt cache", "clients", "same answers", "sequential s", "concurrent s",
              "concurrent / sequential", "model calls (sequential / concurrent)", "batches run / declined"]
    batching, cache = d.get("batching", "always"), _num(d.get("prompt_cache"))
    return header, [([d], [d.get("model", "-"), batching, cache, r["clients"], _num(r["same_answers"]),
                           _num(r["sequential_s"]), _num(r["concurrent_s"]),
                           _num(r["concurrent_s"] / r["sequential_s"]) + "x",
                           f"{r['sequential_model_calls']} / {r['concurrent_model_calls']}",
                           f"{r['concurrent_batches']} / {r['batches_declined']}"
                           if "concurrent_batches" in r else "-"])
                    for r in d["rows"]]


def palettize_compare(d: dict) -> tuple[list[str], list[Row]]:
    header = ["bits", "method", "seconds", "relative error"]
    return header, [([r, d.get("meta", {})], [r["bits"], r["method"], _num(r["seconds"]),
                                              _num(r["rel_error"], 4)]) for r in d["rows"]]


def quantize_smollm2(d: dict) -> tuple[list[str], list[Row]]:
    header = ["scheme", "options", "packages MB", "perplexity", "change vs fp16", "top-1 vs fp16",
              "mean KL"]
    rows = []
    for scheme, e in d.items():
        change = e.get("perplexity_change_pct")
        rows.append(([e], [scheme, " ".join(e.get("options", [])) or "-",
                           _num(e["package_bytes"] / 1e6, 1), _num(e["perplexity"], 3),
                           "-" if change is None else f"{change:+.2f}%",
                           _num(e.get("top1_agreement"), 3), _num(e.get("mean_kl"), 4)]))
    return header, rows


def quantize_sensitivity(d: dict) -> tuple[list[str], list[Row]]:
    header = ["model", "load average", "units", "tokens", "partial passes", "seconds", "16 layers, seconds"]
    rows = []
    for r in d["rows"]:
        full = "-" if "seconds_16_layers" not in r else f"{_num(r['seconds_16_layers'], 1)} ({r['seconds_16_layers_kind']})"
        rows.append(([r], [r["model"], _num(r.get("load_average_1min")), r["units"], r["tokens"], r["passes"],
                           _num(r["seconds"], 1), full]))
    return header, rows


def quantize_forms(d: dict) -> tuple[list[str], list[Row]]:
    header = ["row", "weights MB", "perplexity", "change vs float32", "mean KL"]
    return header, [([r, d], [r["row"], _num(r["weights_mb"], 1), _num(r["perplexity"], 3), f"{r['change_pct']:+.2f}%",
                              _num(r.get("mean_kl"), 4)]) for r in d["rows"]]


def runahead_gpu(d: dict) -> tuple[list[str], list[Row]]:
    header = ["context", "method", "TTFT ms", "kind", "bounds"]
    return header, [([r, d], [r["context"], r["method"], _num(r["ttft_ms"], 1),
                              "estimate" if r.get("estimate") else "measured",
                              r.get("bounds", "-")]) for r in d["speed"]["rows"]]


def runahead_gpu_smollm2(d: dict) -> tuple[list[str], list[Row]]:
    header = ["model", "prompt tokens", "bounds", "method", "max abs diff vs one GPU",
              "rel. L2", "top-1 equal", "greedy tokens identical"]
    rows = []
    s = d.get("smollm2")
    if s:
        for method, key, tokens in (("KV-Runahead", "kvr_vs_single", "kvr_tokens_identical"),
                                    ("sequence parallel", "sp_vs_single", "sp_tokens_identical")):
            c = s[key]
            rows.append(([s, d], ["SmolLM2-135M", s["prompt_tokens"], s["bounds"], method,
                                  _num(c["max_abs_diff"], 4), f"{c['rel_l2']:.1e}",
                                  _num(c["top1_equal"]), _num(s.get(tokens))]))
    r = d.get("random_8b")
    if r:
        c = r["kvr_vs_single"]
        rows.append(([r, d], ["Llama-3.1-8B shapes (random)", r["context"], r["bounds"],
                              "KV-Runahead", _num(c["max_abs_diff"], 4), f"{c['rel_l2']:.1e}",
                              _num(c["top1_equal"]), "-"]))
    return header, rows


def speculative(d: dict) -> tuple[list[str], list[Row]]:
    header = ["task", "kind", "tokens", "tokens / verify step", "acceptance",
              "verify + plain steps", "wall clock (measured)", "lookup oracle (computed)",
              "device (bytes model)"]
    rows = []
    for r in d["rows"]:
        oracle = (r.get("lookup_oracle") or {}).get("speedup")
        device = r.get("device_model_speedup")
        rows.append(([r, d], [r["task"], r.get("kind", "-"), r["generated_tokens"],
                              _num(r["tokens_per_step"]), _num(r["acceptance_rate"]),
                              f"{r['verify_steps']} + {r['decode_steps']}",
                              _num(r["wall_clock_speedup"]) + "x",
                              "-" if oracle is None else _num(oracle) + "x",
                              "-" if device is None else _num(device) + "x"]))
    return header, rows


def generic(d: dict) -> tuple[list[str], list[Row]]:
    """Any other file with a list of flat ``rows``: their scalar fields as columns."""
    rows = d.get("rows") if isinstance(d, dict) else None
    if not isinstance(rows, list) or not rows or not isinstance(rows[0], dict):
        return [], []
    header = [k for k, v in rows[0].items() if not isinstance(v, (dict, list))]
    meta = d.get("meta", {})
    return header, [([r, meta, d], [_num(r.get(k)) for k in header]) for r in rows]


# file stem -> (title, the command that writes it, what the table shows, renderers)
Renderer = Callable[[dict], tuple[list[str], list[Row]]]
BENCHMARKS: dict[str, tuple[str, str, str, list[Renderer]]] = {
    "branches_cpu": ("Cascade branches on a CPU", "python benchmarks/branches_cpu.py",
                     "Branches over one shared prefix as a cascade against each branch decoded "
                     "alone (torch backend).", [branches_cpu]),
    "cpu_runtime": ("Torch backend against transformers on a CPU",
                    "python benchmarks/cpu_runtime.py --repeat 3 --new-tokens 32",
                    "SmolLM2-135M, fp32, same process; ratios are ours over transformers'.",
                    [cpu_runtime]),
    "long_context": ("Long context", "python benchmarks/long_context.py",
                     "Prefill and decode against how full an 8192-token context is, with the "
                     "direct cache and with the cache-update modules a device runs.",
                     [long_context]),
    "speculative": ("Speculative decoding, 1 thread", "python benchmarks/speculative.py",
                    "Greedy SmolLM2-135M on the torch backend; speedups over plain decoding of "
                    "the same tokens. The oracle and the device column are computed, not "
                    "measured.", [speculative]),
    "speculative_2threads": ("Speculative decoding, 2 threads",
                             "python benchmarks/speculative.py --threads 2 --name "
                             "speculative_2threads", "As above, on 2 torch threads.",
                             [speculative]),
    "export_scale": ("Export at real scales", "python benchmarks/export_scale.py --models ...",
                     "Wall time and peak memory (PSS of the process tree) of `llama-ane export` "
                     "on random checkpoints with real models' shapes.", [export_scale]),
    "quantize_smollm2": ("Quantization of SmolLM2", "python benchmarks/quantize_smollm2.py",
                         "Perplexity on the shipped held-out prose (mil backend) and agreement "
                         "with the fp16 export.", [quantize_smollm2]),
    "quantize_sensitivity": ("`--quantize auto`: the sensitivity phase alone",
                             "python benchmarks/quantize_sensitivity.py",
                             "Seconds to measure every unit (quantize.sensitivity.measure_units) on SmolLM2 and on a "
                             "Llama-3.2-1B-shaped model with random weights (some of its layers, the 16-layer time "
                             "extrapolated and labelled so), with the load average when the row started.",
                             [quantize_sensitivity]),
    "quantize_forms": ("LUT forms part by part on SmolLM2", "python benchmarks/quantize_forms.py",
                       "Float32 in torch, perplexity and mean KL from float32 on the held-out prose with the "
                       "named parts in one form and every other part lut6 (groups of 8, plain codes); the "
                       "weights' compressed bytes.",
                       [quantize_forms]),
    "serve": ("Server: concurrent clients on one tiny export", "python benchmarks/serve.py --repeats 5 --threads 1",
              "`llama-ane serve` (torch, fp32) under 1-8 clients asking about one shared document, all at "
              "once against one after another; greedy answers of equal length, the fastest of the runs. "
              "Results before `--batching` existed batched always.", [serve]),
    "coreai_memory": ("Core AI: memory over a long decode", "python benchmarks/coreai_memory.py",
                      "PSS of a process decoding 2000 tokens greedily on the coreai backend (tiny random "
                      "Llama, --target coreai, fp32), with each cache kind, beside the bytes of outputs the "
                      "runtime returned, which it keeps.", [generic]),
    "one_copy": ("Copies of the weights on the Neural Engine (modelled)", "python benchmarks/one_copy.py",
                 "Published shapes, context 1024, M4: resident copies of the weights by the load plan "
                 "(contract/resident.py), time to first token of 512 tokens and decode at the last position, "
                 "with decode functions and with the prefill window decoding. Modelled, not measured.", [generic]),
    "transformers_latest": ("transformers: the newest release", "python benchmarks/transformers_latest.py",
                            "The family tests (torch fp32 against each family's class, and the parity gate's "
                            "reference) with that release installed apart; `make check-transformers`.",
                            [generic]),
    "transformers_floor": ("transformers: the oldest release in the declared range",
                           "python benchmarks/transformers_latest.py --version 5.15.0 --name transformers_floor",
                           "As above, at the floor of pyproject.toml's range.", [generic]),
    "serve_smollm2": ("Server: concurrent clients on SmolLM2",
                      "python benchmarks/serve.py --smollm2 --prefix-tokens 600 --repeats 3 --threads 1",
                      "As above, on the embedded SmolLM2-135M-Instruct, the prompts sharing 600 tokens.", [serve]),
    "palettize_compare": ("LUT fitting against coremltools",
                          "python benchmarks/palettize_compare.py --layers 1",
                          "Seconds and relative error of palettizing 8M of SmolLM2's weights.",
                          [palettize_compare]),
    "cuda_cascade": ("CUDA: shared-prefix batch decode against FlashInfer",
                     "python benchmarks/cascade_gpu.py --skip-sweep",
                     "D=128, page 16, fp16, L2 flushed, median of the recorded repetitions; "
                     "then plain paged decode with no sharing.",
                     [cuda_cascade, cuda_decode_bandwidth]),
    "cuda_tree": ("CUDA: tree attention", "python benchmarks/tree_gpu.py",
                  "4096-token prompt, D=128, fp16, page size 1.", [cuda_tree]),
    "cuda_engine": ("CUDA: GPU engine against transformers", "python benchmarks/engine_gpu.py",
                    "Greedy decoding of n branches after a 1024-token prompt, SmolLM2-135M "
                    "shapes, fp16; whole calls.", [cuda_engine]),
    "runahead_gpu": ("CUDA: KV-Runahead time to first token", "python benchmarks/runahead_gpu.py",
                     "Llama-3.1-8B shapes, bf16. Estimate rows are the slowest rank's compute "
                     "alone, without communication: a lower bound, not a measurement.",
                     [runahead_gpu]),
    "runahead_gpu_smollm2": ("CUDA: KV-Runahead correctness",
                             "python benchmarks/runahead_gpu.py --skip-speed --smollm2-dir DIR",
                             "Last-token logits and greedy tokens after the runahead cache "
                             "against one GPU's prefill.", [runahead_gpu_smollm2]),
}


def table(header: list[str], rows: list[Row]) -> list[str]:
    head = ["date", "machine", "commit"] + header
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for sources, cells in rows:
        text = [str(c).replace("|", "\\|").replace("\n", " ") for c in stamps(sources) + cells]
        lines.append("| " + " | ".join(text) + " |")
    return lines


def render(results: Path) -> str:
    out = ["# Benchmarks", "",
           f"Generated by `benchmarks/report.py` from `benchmarks/results/*.json`; do not edit by "
           "hand. Each row is stamped with the date, machine and commit its results file "
           f'records, "{UNKNOWN}" where it records none. Design notes on what these numbers mean '
           "are in [../docs/](../docs/).", ""]
    files = sorted(results.glob("*.json"))
    known = [f for f in files if f.stem in BENCHMARKS]
    known.sort(key=lambda f: list(BENCHMARKS).index(f.stem))
    for f in known + [f for f in files if f.stem not in BENCHMARKS]:
        data = json.loads(f.read_text())
        title, command, about, renderers = BENCHMARKS.get(
            f.stem, (f.stem, UNKNOWN, "No table layout for this file: its rows' scalar fields.",
                     [generic]))
        out += [f"## {title}", "", f"`{command}` writes [results/{f.name}](results/{f.name}). "
                + about, ""]
        for renderer in renderers:
            header, rows = renderer(data)
            out += table(header, rows) if rows else ["(no rows)"]
            out.append("")
        png = f.with_suffix(".png")
        if png.exists():
            out += [f"![{title}](results/{png.name})", ""]
    return "\n".join(out).rstrip() + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--out", type=Path, default=HERE / "README.md")
    args = parser.parse_args()
    args.out.write_text(render(args.results))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
