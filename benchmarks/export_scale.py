"""Wall time, peak memory, output size and /tmp leftovers of `llama-ane export` at real model scales.

Writes random bf16 checkpoints shaped exactly like Llama-3.2-1B, Llama-3.2-3B and Llama-3.1-8B, or
Gemma-3-1B, Gemma-3-4B, Gemma-4-E2B, Qwen3-1.7B, Qwen3-4B, Qwen3.5-4B, SmolLM3-3B, Phi-4-mini and Falcon-H1-1.5B (the
text models of their published configs; sharded safetensors, as the hub ships them) into --workdir,
runs the real CLI on each as a subprocess and measures it: peak memory is the summed PSS of its
process tree (forked workers count once). Optionally: `inspect --strict` (default for 8b), a second export compared hash for hash
(--repeat), and the same export by the exporter of another git ref (--reference) for new/reference
ratios. Results are merged into benchmarks/results/export_scale.{json,md}.

    python benchmarks/export_scale.py --models 1b --reference 4d46c05
    python benchmarks/export_scale.py --models tiny,smollm2 -- --no-verify --max-memory 10
    python benchmarks/export_scale.py --models 8b --repeat --keep
    python benchmarks/export_scale.py --models 1b --label 1b-lut4 --inspect -- --quantize lut4 --quantize-lm-head lut6

Each run records its wall time, the CPU seconds of the export's process tree (the work done, which
other load on the machine barely changes), the 1-minute load average before and after, and the peak.

Presets: 1b, 3b, 8b, tiny (2 layers, seconds), gemma3-1b, gemma3-4b, gemma4-e2b, qwen3-1.7b, qwen3-4b,
qwen3.5-4b, smollm3-3b, phi4-mini, falcon-h1-1.5b, smollm2 (the embedded default model). Arguments after `--` go to
the new exporter only.
Checkpoints are kept unless --clean, exports removed unless --keep.
Exit status 1 if any export (or inspect) failed.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import functools
import json
import os
import shlex
import shutil
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from llama_ane.memory import GIB, PeakMemory, wait_and_sample

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
SHARD_LIMIT = 2 * GIB
NAMES = {"1b": "Llama-3.2-1B", "3b": "Llama-3.2-3B", "8b": "Llama-3.1-8B", "tiny": "tiny-llama",
         "gemma3-1b": "Gemma-3-1B", "gemma3-4b": "Gemma-3-4B", "gemma4-e2b": "Gemma-4-E2B", "qwen3-1.7b": "Qwen3-1.7B", "qwen3-4b": "Qwen3-4B",
         "qwen3.5-4b": "Qwen3.5-4B", "smollm3-3b": "SmolLM3-3B", "phi4-mini": "Phi-4-mini",
         "falcon-h1-1.5b": "Falcon-H1-1.5B"}
PRESETS = (*NAMES, "smollm2")
MARKER = ".complete"
INIT = 2  # how write_shard fills tensors: a checkpoint written by another rule is written again
TAIL = 40
# vectors a layer multiplies by w, not (1 + w): Gemma 4's layer scalars, Gated DeltaNet's gated norm
# (whatever norm the family's other norms use) and its dt_bias; a Mamba-2 mixer's dt_bias and D skip
# (as transformers initializes them)
ONES = ("layer_scalar", "linear_attn.norm.weight", "linear_attn.dt_bias", "mamba.dt_bias", "mamba.D")


class BenchError(RuntimeError):
    """A problem the user has to fix before the benchmark can run (disk space, unknown preset...)."""


# Phi-4-mini's longrope factors, one per rotated channel pair (96 of its 128 head channels rotate)
PHI4_MINI_LONG_FACTOR = [
    1.0, 1.118320672, 1.250641126, 1.398617824, 1.564103225, 1.74916897, 1.956131817, 2.187582649, 2.446418898,
    2.735880826, 3.059592084, 3.421605075, 3.826451687, 4.279200023, 4.785517845, 5.351743533, 5.984965424,
    6.693110555, 7.485043894, 8.370679318, 9.36110372, 10.4687158, 11.70738129, 13.09260651, 14.64173252,
    16.37415215, 18.31155283, 20.47818807, 22.90118105, 25.61086418, 28.64115884, 32.03, 32.1, 32.13, 32.23, 32.6,
    32.61, 32.64, 32.66, 32.7, 32.71, 32.93, 32.97, 33.28, 33.49, 33.5, 44.16, 47.77]


def _gemma3(vocab: int, hidden: int, inter: int, layers: int, heads: int, kv: int, window: int, max_pos: int,
            rope_scaling: dict | None) -> dict:
    """The text model of a Gemma 3 checkpoint: five sliding layers (local RoPE base 10k) to a global one
    (base 1M), 256-channel heads scaled by query_pre_attn_scalar, q/k norms, (1 + w) norms."""
    return {"model_type": "gemma3_text", "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": inter,
            "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": 256,
            "query_pre_attn_scalar": 256, "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "rope_scaling": rope_scaling,
            "sliding_window": window, "sliding_window_pattern": 6, "max_position_embeddings": max_pos,
            "attn_logit_softcapping": None, "final_logit_softcapping": None, "attention_bias": False,
            "tie_word_embeddings": True, "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0}


def _gemma4(hidden: int, inter: int, layers: int, kv: int, pattern: int, shared: int, double_wide: bool) -> dict:
    """The text model of a Gemma 4 E-series checkpoint: `pattern` - 1 sliding layers (256-channel heads, a
    512 window, RoPE base 10k) to a global one (512-channel heads, proportional RoPE on a quarter of
    them, base 1M), per-layer inputs of 256 channels a layer, the last `shared` layers KV-shared."""
    return {"model_type": "gemma4_text", "vocab_size": 262144, "vocab_size_per_layer_input": 262144,
            "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
            "num_attention_heads": 8, "num_key_value_heads": kv, "head_dim": 256, "global_head_dim": 512,
            "hidden_size_per_layer_input": 256, "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-6,
            "sliding_window": 512, "max_position_embeddings": 131072, "final_logit_softcapping": 30.0,
            "layer_types": (["sliding_attention"] * (pattern - 1) + ["full_attention"]) * (layers // pattern),
            "rope_parameters": {"full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                   "rope_theta": 1000000.0},
                                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
            "attention_k_eq_v": False, "num_kv_shared_layers": shared, "use_double_wide_mlp": double_wide,
            "attention_bias": False, "tie_word_embeddings": True, "bos_token_id": 2, "eos_token_id": 1,
            "pad_token_id": 0}


def _qwen3(hidden: int, inter: int, layers: int, heads: int) -> dict:
    """A dense Qwen3 checkpoint: 8 KV heads of 128 channels, q/k norms, tied embeddings, no window."""
    return {"model_type": "qwen3", "vocab_size": 151936, "hidden_size": hidden, "intermediate_size": inter,
            "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": 8, "head_dim": 128,
            "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "rope_scaling": None,
            "max_position_embeddings": 40960, "use_sliding_window": False, "sliding_window": None,
            "max_window_layers": layers, "attention_bias": False, "tie_word_embeddings": True,
            "bos_token_id": 151643, "eos_token_id": 151645}


# The published config.json fields of the other families' presets, each read by transformers' own
# config class of the family (the first item), which fills the defaults and checks the values
FAMILY_PRESETS: dict[str, tuple[str, dict]] = {
    "gemma3-1b": ("Gemma3TextConfig", _gemma3(262144, 1152, 6912, 26, 4, 1, 512, 32768, None)),
    # the language model of the multimodal checkpoint, as a text model's checkpoint holds it
    "gemma3-4b": ("Gemma3TextConfig", _gemma3(262208, 2560, 10240, 34, 8, 4, 1024, 131072,
                                              {"rope_type": "linear", "factor": 8.0})),
    # the text model of the E2B checkpoint (its KV-shared layers export with --kv-cache inputs)
    "gemma4-e2b": ("Gemma4TextConfig", _gemma4(1536, 6144, 35, 1, 5, 20, True)),
    "qwen3-1.7b": ("Qwen3Config", _qwen3(2048, 6144, 28, 16)),
    "qwen3-4b": ("Qwen3Config", _qwen3(2560, 9728, 36, 32)),
    # the text model of the 4B checkpoint: three Gated DeltaNet layers to each gated attention layer
    "qwen3.5-4b": ("Qwen3_5TextConfig", {
        "model_type": "qwen3_5_text", "vocab_size": 248320, "hidden_size": 2560, "intermediate_size": 9216,
        "num_hidden_layers": 32, "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 256,
        "hidden_act": "silu", "rms_norm_eps": 1e-6, "max_position_embeddings": 262144,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
        "layer_types": ["full_attention" if (n + 1) % 4 == 0 else "linear_attention" for n in range(32)],
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
        "linear_num_key_heads": 16, "linear_num_value_heads": 32, "attention_bias": False,
        "tie_word_embeddings": True, "bos_token_id": None, "eos_token_id": 248046}),
    # attention and a Mamba-2 mixer side by side in all 24 layers (the published sizes; the muP
    # multipliers left at 1, which changes no shape)
    "falcon-h1-1.5b": ("FalconH1Config", {
        "model_type": "falcon_h1", "vocab_size": 65537, "hidden_size": 2048, "intermediate_size": 4608,
        "num_hidden_layers": 24, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 128,
        "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 100000000000.0, "max_position_embeddings": 131072,
        "mamba_d_ssm": 3072, "mamba_n_heads": 48, "mamba_d_head": 64, "mamba_n_groups": 1, "mamba_d_state": 256,
        "mamba_d_conv": 4, "mamba_conv_bias": True, "mamba_proj_bias": False, "mamba_rms_norm": True,
        "mamba_norm_before_gate": False, "attention_bias": False, "projectors_bias": False,
        "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 11, "pad_token_id": 0}),
    "smollm3-3b": ("SmolLM3Config", {
        "model_type": "smollm3", "vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 11008,
        "num_hidden_layers": 36, "num_attention_heads": 16, "num_key_value_heads": 4, "hidden_act": "silu",
        "rms_norm_eps": 1e-6, "rope_theta": 5000000.0, "rope_scaling": None, "max_position_embeddings": 65536,
        # every fourth layer applies no RoPE (0 in no_rope_layers)
        "no_rope_layer_interval": 4, "no_rope_layers": [int((n + 1) % 4 != 0) for n in range(36)],
        "use_sliding_window": False, "sliding_window": None, "attention_bias": False, "mlp_bias": False,
        "tie_word_embeddings": True, "bos_token_id": None, "eos_token_id": 128012, "pad_token_id": 128004}),
    "phi4-mini": ("Phi3Config", {
        "model_type": "phi3", "vocab_size": 200064, "hidden_size": 3072, "intermediate_size": 8192,
        "num_hidden_layers": 32, "num_attention_heads": 24, "num_key_value_heads": 8, "hidden_act": "silu",
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
        "max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
        "rope_scaling": {"type": "longrope", "long_factor": PHI4_MINI_LONG_FACTOR, "short_factor": [1.0] * 48},
        "sliding_window": 262144, "attention_bias": False, "tie_word_embeddings": True,
        "bos_token_id": 199999, "eos_token_id": 200020, "pad_token_id": 199999}),
}


def family_config(config_class: str, fields: dict) -> dict:
    """A config.json as transformers writes it for `fields` (`config_class` filling the defaults and, in
    transformers 5, the rope_parameters and layer_types forms), keeping the published fields it rewrites."""
    import transformers

    from llama_ane.config import FAMILY_CLASS_PREFIX

    written = getattr(transformers, config_class)(**copy.deepcopy(fields)).to_diff_dict()
    return {**fields, **written, "architectures": [f"{FAMILY_CLASS_PREFIX[fields['model_type']]}ForCausalLM"],
            "torch_dtype": "bfloat16"}


def preset_config(preset: str) -> dict | None:
    """The config.json of a preset (a fresh dict), or None for smollm2, which has nothing to write."""
    if preset == "smollm2":
        return None
    if preset in FAMILY_PRESETS:
        return family_config(*FAMILY_PRESETS[preset])
    shapes = {  # hidden, intermediate, layers, heads, kv heads, head_dim, tied, rope factor, vocab
        "1b": (2048, 8192, 16, 32, 8, 64, True, 32.0, 128256),
        "3b": (3072, 8192, 28, 24, 8, 128, True, 32.0, 128256),
        "8b": (4096, 14336, 32, 32, 8, 128, False, 8.0, 128256),
        # the vocabulary of the SmolLM2 tokenizer it is given, so every token id is a valid row
        "tiny": (128, 256, 2, 4, 2, 32, True, 32.0, 49152),
    }
    if preset not in shapes:
        raise BenchError(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
    h, i, n, heads, kv, hd, tied, factor, vocab = shapes[preset]
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
        "hidden_size": h, "intermediate_size": i, "num_hidden_layers": n, "num_attention_heads": heads,
        "num_key_value_heads": kv, "head_dim": hd, "hidden_act": "silu", "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "max_position_embeddings": 131072,
        "rope_scaling": {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        "tie_word_embeddings": tied, "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0,
        "initializer_range": 0.02, "pretraining_tp": 1, "use_cache": True, "torch_dtype": "bfloat16",
        # tiny keeps the SmolLM2 tokenizer's own ids: 128000/128001 are outside its 49152 rows
        "bos_token_id": 1 if preset == "tiny" else 128000, "eos_token_id": 2 if preset == "tiny" else 128001,
    }


def tensor_shapes(cfg: dict) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor a checkpoint of `cfg` stores, with its HF name and shape, in file order: the state
    dict of the family's transformers class built on the meta device (no memory), a tied LM head left out."""
    return [(name, shape) for name, shape in _tensor_shapes(json.dumps(cfg, sort_keys=True))]


@functools.lru_cache(maxsize=8)
def _tensor_shapes(cfg_json: str) -> tuple[tuple[str, tuple[int, ...]], ...]:
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = json.loads(cfg_json)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    seen: set[int] = set()
    shapes = []
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) not in seen:  # a tied weight is the same parameter under a second name, stored once
            seen.add(id(tensor))
            shapes.append((name, tuple(tensor.shape)))
    return tuple(shapes)


def param_count(cfg: dict) -> int:
    """Parameters a checkpoint of `cfg` stores (one embedding matrix if tied)."""
    return sum(int(torch.Size(shape).numel()) for _, shape in tensor_shapes(cfg))


def norm_value(cfg: dict) -> float:
    """What a norm weight holds so that it scales by 1: 0 where the family multiplies by (1 + w)."""
    from llama_ane.config import UNIT_OFFSET_NORMS

    return 0.0 if cfg["model_type"] in UNIT_OFFSET_NORMS else 1.0


def plan_shards(shapes: list[tuple[str, tuple[int, ...]]], limit: int) -> list[list[tuple[str, tuple[int, ...]]]]:
    """Group tensors in order into shards whose files (header included) stay within `limit` bytes; a
    tensor larger than that gets a shard of its own, as transformers' save_pretrained writes it
    (Gemma 4's per-layer table)."""
    shards: list[list] = [[]]
    used = 64  # length prefix, metadata and padding of the header
    for name, shape in shapes:
        need = 2 * int(torch.Size(shape).numel()) + 128 + len(name)  # data + a bound on its header entry
        if used + need > limit and shards[-1]:
            shards.append([])
            used = 64
        shards[-1].append((name, shape))
        used += need
    return shards


def write_shard(file: Path, shard: list[tuple[str, tuple[int, ...]]], gen: torch.Generator,
                norm: float = 1.0, qk_temperature: bool = False) -> dict[str, str]:
    """Write one safetensors file tensor by tensor, so only one tensor is in memory at a time: matrices
    random, in file order from `gen`; norm weights all `norm`, other vectors (biases) zeros, but 1 for
    the vectors that scale by w itself (ONES: as transformers initializes them; at 0 they would zero
    a layer's output). A Gated DeltaNet layer's A_log of 0 gives a decay rate A of 1.

    With `qk_temperature` (Gemma 4, whose attention scale is 1: its trained q/k norm weights set the
    temperature), q and k norm weights are head_dim ** -0.25, so attention logits have unit variance;
    at 1 they have head_dim's, and a random model's attention is so peaked that any rounding flips
    which key a query attends to (no precision's logits then match another's)."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in shard:
        size = 2 * int(torch.Size(shape).numel())
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # safetensors aligns the data to 8 bytes
    with open(file, "wb") as f:
        f.write(len(blob).to_bytes(8, "little") + blob)
        for name, shape in shard:
            fill = 1.0 if name.endswith(ONES) else norm if "norm" in name else 0.0
            if qk_temperature and name.endswith(("q_norm.weight", "k_norm.weight")):
                fill = shape[0] ** -0.25
            t = (torch.full(shape, fill, dtype=torch.bfloat16) if len(shape) == 1
                 else torch.empty(shape, dtype=torch.bfloat16).normal_(0.0, 0.02, generator=gen))
            f.write(memoryview(t.view(torch.uint8).numpy()))
    return {name: file.name for name, _ in shard}


def write_checkpoint(cfg: dict, folder: Path, seed: int = 0, shard_limit: int = SHARD_LIMIT,
                     tokenizer: bool = True) -> bool:
    """Write a random HF checkpoint for `cfg` into `folder` unless a complete one is there; True if written."""
    stamp = json.dumps({"config": cfg, "seed": seed, "shard_limit": shard_limit, "init": INIT}, sort_keys=True)
    marker = folder / MARKER
    if marker.is_file() and marker.read_text() == stamp and (not tokenizer or (folder / "tokenizer.json").is_file()):
        return False
    shutil.rmtree(folder, ignore_errors=True)  # a checkpoint that did not finish, or of another config
    folder.mkdir(parents=True)
    need, free = 2 * param_count(cfg), shutil.disk_usage(folder).free
    if need > free:
        folder.rmdir()
        raise BenchError(f"the {folder.name} checkpoint needs {need / GIB:.1f} GiB but {folder.parent} has "
                         f"{free / GIB:.1f} GiB free; free some space or pass --workdir elsewhere")
    shards = plan_shards(tensor_shapes(cfg), shard_limit)
    gen = torch.Generator().manual_seed(seed)
    weight_map: dict[str, str] = {}
    for k, shard in enumerate(shards, 1):
        weight_map.update(write_shard(folder / f"model-{k:05d}-of-{len(shards):05d}.safetensors", shard, gen,
                                      norm_value(cfg), cfg["model_type"] == "gemma4_text"))
    index = {"metadata": {"total_size": need}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (folder / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    if tokenizer:
        from transformers import AutoTokenizer

        from llama_ane.checkpoint.loader import default_gguf_path

        gguf = default_gguf_path()  # no network here: the embedded SmolLM2 tokenizer, ids < every vocab
        AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(str(folder))
    marker.write_text(stamp)
    return True


def tree_bytes(path: Path) -> int:
    """Bytes of a file, or of every file under a folder (symlinks not followed; unreadable = 0)."""
    try:
        if stat.S_ISDIR(path.lstat().st_mode):
            return sum(tree_bytes(p) for p in path.iterdir())
        return path.lstat().st_size
    except OSError:
        return 0


def _pump(stream, sink) -> None:
    """Copy a child's output to the console and its log as it comes (progress bars included)."""
    for chunk in iter(lambda: stream.read1(1 << 16), b""):
        sys.stdout.buffer.write(chunk)
        sys.stdout.flush()
        sink.write(chunk)


def log_tail(log: Path, lines: int = TAIL) -> list[str]:
    """The last lines of a log as a terminal shows them (only the last redraw of a progress bar)."""
    text = log.read_bytes()[-(1 << 16):].decode(errors="replace")
    shown = [ln.rsplit("\r", 1)[-1].rstrip() for ln in text.replace("\r\n", "\n").split("\n")]
    return [ln for ln in shown if ln][-lines:]


def run_export(cmd: list[str], out: Path, log: Path, cwd: Path, env: dict[str, str]) -> dict:
    """Run one export command, streaming its output to the console and `log`, and measure it.

    The command gets a temporary folder of its own (TMPDIR, an empty folder next to the log), so
    what it leaves there is its own and not another process's; the folder is removed afterwards."""
    tmp = log.parent / f"tmp-{log.stem}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    env = {**env, "TMPDIR": str(tmp)}
    before: set[str] = set()
    print(f"$ {shlex.join(cmd)}", flush=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    cpu0 = _children_cpu()
    load0 = os.getloadavg()[0]
    with open(log, "wb") as sink:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        pump = threading.Thread(target=_pump, args=(proc.stdout, sink), daemon=True)
        pump.start()
        meter = PeakMemory(root=proc.pid)
        code = wait_and_sample(proc, meter)
        pump.join()
    wall = time.perf_counter() - t0
    cpu = _children_cpu() - cpu0
    load1 = os.getloadavg()[0]
    left = sorted({p.name for p in tmp.iterdir()} - before)
    left_bytes = sum(tree_bytes(tmp / n) for n in left)
    shutil.rmtree(tmp, ignore_errors=True)
    files = {p.name: tree_bytes(p) for p in sorted(out.iterdir())} if out.is_dir() else {}
    text = log.read_text(errors="replace")
    passed = any(ln.strip() == "passed" for ln in text.replace("\r", "\n").split("\n"))
    return {"command": shlex.join(cmd), "exit_code": code, "wall_s": round(wall, 1), "cpu_s": round(cpu, 1),
            "load_average": [round(load0, 2), round(load1, 2)],
            "peak_pss_gib": round(meter.peak / GIB, 3), "memory_method": meter.method, "files": files,
            "total_bytes": sum(files.values()),
            "verify": "passed" if passed else ("skipped" if "--no-verify" in cmd else "not passed"),
            "tmp_leftovers": {"names": left, "bytes": left_bytes},
            "log": str(log), "output_tail": log_tail(log)}


def _children_cpu() -> float:
    """User + system CPU seconds of every finished child process tree (an export and its workers):
    the work an export did, which the machine's other load does not change as it changes wall time."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def manifest_hashes(out: Path) -> dict[str, str]:
    """The per-file sha256 map of an export's manifest.json (empty if there is none)."""
    path = out / "manifest.json"
    return json.loads(path.read_text()).get("files", {}) if path.is_file() else {}


def git(*args: str) -> str:
    """Output of a git command in the repository, stripped; BenchError with git's message on failure."""
    r = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
    if r.returncode:
        raise BenchError(f"git {' '.join(args)}: {r.stderr.strip()}")
    return r.stdout.strip()


def remove_worktree(path: Path) -> None:
    """Remove a worktree made by `add_worktree`, and git's record of it."""
    subprocess.run(["git", "worktree", "remove", "--force", str(path)], cwd=ROOT, capture_output=True)
    shutil.rmtree(path, ignore_errors=True)
    subprocess.run(["git", "worktree", "prune"], cwd=ROOT, capture_output=True)


def add_worktree(ref: str, workdir: Path) -> Path:
    """A detached worktree of `ref` in the work folder, checked to be what `-m llama_ane` imports there."""
    path = workdir / f"ref-{git('rev-parse', '--short', '--verify', ref + '^{commit}')}"
    remove_worktree(path)  # one left by an interrupted run
    git("worktree", "add", "--detach", str(path), ref)
    probe = subprocess.run([sys.executable, "-c", "import llama_ane; print(llama_ane.__file__)"], cwd=path,
                           env={**os.environ, "PYTHONPATH": str(path)}, capture_output=True, text=True)
    if not probe.stdout.strip().startswith(str(path)):
        remove_worktree(path)
        raise BenchError(f"{ref}'s llama_ane is not what `-m llama_ane` imports in its worktree "
                         f"({probe.stdout}{probe.stderr})")
    return path


def machine() -> dict:
    """CPU count and total memory of this machine."""
    meminfo = Path("/proc/meminfo").read_text().splitlines() if Path("/proc/meminfo").is_file() else []
    kib = next((int(ln.split()[1]) for ln in meminfo if ln.startswith("MemTotal:")), 0)
    return {"cpu_count": os.cpu_count(), "mem_total_gib": round(kib * 1024 / GIB, 1)}


def benchmark(preset: str, args: argparse.Namespace, extra: list[str], ref_tree: Path | None) -> dict:
    """Prepare the checkpoint of one preset, export it (and its reference, repeat, inspect), and measure."""
    cfg = preset_config(preset)
    work = args.workdir
    ckpt = work / "checkpoints" / NAMES[preset] if cfg else None
    if cfg and write_checkpoint(cfg, ckpt, seed=args.seed):
        print(f"wrote {ckpt} ({param_count(cfg):,} parameters)", flush=True)
    exports, logs = work / "exports", work / "logs"

    def export(out: Path, tree: Path, more: list[str], label: str) -> dict:
        cmd = [sys.executable, "-m", "llama_ane", "export", *([str(ckpt)] if ckpt else []), "-o", str(out), "--force"]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **({"PYTHONPATH": str(tree)} if tree != ROOT else {})}
        return run_export(cmd + more, out, logs / f"{preset}-{label}.log", tree, env)

    def drop(out: Path) -> None:
        if not args.keep:
            shutil.rmtree(out, ignore_errors=True)

    entry: dict = {"model": preset, "checkpoint": str(ckpt) if ckpt else "embedded SmolLM2",
                   "params": param_count(cfg) if cfg else None, "command": args.command_line,
                   "extra_args": extra, "commit": args.commit, "machine": machine(),
                   "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    if ref_tree is not None:  # its export is removed before the new one runs: at 8b each is ~16 GB
        out = exports / f"{preset}-ref"
        entry["reference"] = {"ref": args.reference, "commit": git("rev-parse", "--short", args.reference),
                              **export(out, ref_tree, [], "ref")}
        drop(out)
    out = exports / preset
    entry["new"] = export(out, ROOT, extra, "new")
    ok = entry["new"]["exit_code"] == 0
    if ok and (args.inspect if args.inspect is not None else preset == "8b"):
        r = subprocess.run([sys.executable, "-m", "llama_ane", "inspect", str(out), "--strict"], cwd=ROOT,
                           capture_output=True, text=True)
        entry["inspect"] = {"exit_code": r.returncode, "output_tail": (r.stdout + r.stderr).splitlines()[-TAIL:]}
    if ok and args.repeat:
        out2 = exports / f"{preset}-2"
        second = export(out2, ROOT, extra, "repeat")
        first_hashes, second_hashes = manifest_hashes(out), manifest_hashes(out2)
        differ = sorted(k for k in first_hashes.keys() | second_hashes.keys()
                        if first_hashes.get(k) != second_hashes.get(k))
        entry["repeat"] = {"identical": second["exit_code"] == 0 and bool(first_hashes) and not differ,
                           "differing_files": differ, **{k: second[k] for k in ("exit_code", "wall_s", "peak_pss_gib")}}
        drop(out2)
    drop(out)
    ref = entry.get("reference")
    if ref and ref["exit_code"] == 0 and ok:
        entry["ratios"] = {"wall": round(entry["new"]["wall_s"] / ref["wall_s"], 3),
                           "peak": round(entry["new"]["peak_pss_gib"] / ref["peak_pss_gib"], 3)}
        print(f"{preset}: new/reference wall {entry['ratios']['wall']:.2f}x, peak {entry['ratios']['peak']:.2f}x")
    if args.clean and ckpt:
        shutil.rmtree(ckpt, ignore_errors=True)
    entry["failed"] = any(entry.get(k, {}).get("exit_code", 0) != 0 for k in ("new", "reference", "repeat", "inspect"))
    return entry


def table(results: dict) -> str:
    """A markdown table of every model in the results file."""
    rows = ["| model | exit | wall s | cpu s | load | peak GiB | packages GB | verify | /tmp leftovers | inspect | "
            "repeat identical | new/ref wall, peak |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, e in results.items():
        n, left = e["new"], e["new"]["tmp_leftovers"]
        ratio = f"{e['ratios']['wall']:.2f}x, {e['ratios']['peak']:.2f}x" if "ratios" in e else "-"
        leftovers = f"{len(left['names'])} ({left['bytes'] / 1e6:.1f} MB)" if left["names"] else "none"
        inspect = "-" if "inspect" not in e else "ok" if e["inspect"]["exit_code"] == 0 else "FAIL"
        repeat = "-" if "repeat" not in e else "yes" if e["repeat"]["identical"] else "NO"
        cpu = f"{n['cpu_s']:.1f}" if "cpu_s" in n else "-"
        load = "-" if "load_average" not in n else "{:.1f}-{:.1f}".format(*n["load_average"])
        rows.append(f"| {name} | {n['exit_code']} | {n['wall_s']:.1f} | {cpu} | {load} | {n['peak_pss_gib']:.2f} | "
                    f"{n['total_bytes'] / 1e9:.2f} | {n['verify']} | {leftovers} | {inspect} | {repeat} | {ratio} |")
    return "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Parse the command line (arguments after `--` go to the new exporter), run, write the results."""
    argv = sys.argv[1:] if argv is None else argv
    cut = argv.index("--") if "--" in argv else len(argv)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="1b", help=f"comma-separated presets: {','.join(PRESETS)}")
    ap.add_argument("--workdir", type=Path, default=ROOT / "benchmarks" / ".scale")
    ap.add_argument("--reference", metavar="GIT_REF", help="also export with the exporter at this git ref")
    ap.add_argument("--inspect", action=argparse.BooleanOptionalAction, default=None,
                    help="run `inspect --strict` on the export [default: only for 8b]")
    ap.add_argument("--repeat", action="store_true", help="export twice and compare the manifests' hashes")
    ap.add_argument("--keep", action="store_true", help="keep the exports (default: removed after measuring)")
    ap.add_argument("--clean", action="store_true", help="delete the checkpoints after measuring")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--label", help="record the (single) model under this name instead of its preset, e.g. for "
                                    "a run with other exporter options")
    args = ap.parse_args(argv[:cut])
    args.command_line = shlex.join(["python", "benchmarks/export_scale.py", *argv])
    extra = argv[cut + 1:]
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in PRESETS]
    if unknown or not models:
        ap.error(f"unknown preset(s) {', '.join(unknown) or '(none given)'}; choose from {', '.join(PRESETS)}")
    args.workdir = args.workdir.resolve()
    args.workdir.mkdir(parents=True, exist_ok=True)
    args.commit = git("rev-parse", "--short", "HEAD") + ("-dirty" if git("status", "--porcelain") else "")
    path = RESULTS / "export_scale.json"
    results = json.loads(path.read_text()) if path.is_file() else {}
    ref_tree = None
    try:
        ref_tree = add_worktree(args.reference, args.workdir) if args.reference else None
        if args.label and len(models) != 1:
            raise BenchError("--label names the results of one model: give one --models preset")
        for preset in models:
            results[args.label or preset] = benchmark(preset, args, extra, ref_tree)
            RESULTS.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(results, indent=2) + "\n")  # after each model: a later crash keeps it
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        if ref_tree is not None:
            remove_worktree(ref_tree)
    md = table(results)
    (RESULTS / "export_scale.md").write_text(md)
    print("\n" + md)
    return 1 if any(results[args.label or m]["failed"] for m in models) else 0


if __name__ == "__main__":
    sys.exit(main())
