"""Reading checkpoints: Hugging Face folders, .gguf files and the embedded default, tensor by tensor
(`loader`, `gguf_lazy`), and the pure mapping of their tensors onto our modules (`mapping`)."""

from .loader import (DEFAULT_GGUF, DEFAULT_MODEL_NAME, Checkpoint, CheckpointError, copy_tokenizer,
                     default_gguf_path, load_checkpoint, source_path)

__all__ = ["Checkpoint", "CheckpointError", "DEFAULT_GGUF", "DEFAULT_MODEL_NAME", "copy_tokenizer",
           "default_gguf_path", "load_checkpoint", "source_path"]
