"""llama-ane: Llama checkpoints as chunked Core ML programs for the Apple Neural Engine.

    import llama_ane
    llama_ane.export_model(None, "out/smollm2")          # the embedded default model
    model = llama_ane.load("out/smollm2")                 # coreml on macOS, torch elsewhere
    print(model.generate("What is the capital of France?", max_new_tokens=16).text)
"""

from ._version import __version__


def load(path, backend="auto", **options):
    """Load an export folder; see `llama_ane.runtime.model.load`."""
    from ._quiet import quiet_coremltools
    from .runtime.model import load as _load

    quiet_coremltools()
    return _load(path, backend, **options)


def export_model(source, out, **options):
    """Export a checkpoint; see `llama_ane.api.export_model`."""
    from ._quiet import quiet_coremltools
    from .api import export_model as _export

    quiet_coremltools()
    return _export(source, out, **options)


__all__ = ["load", "export_model", "__version__"]
