"""The exporter: each package of an export plan built as a MIL program straight from the checkpoint,
one package's weights per worker process (`convert`, `programs`, `package_weights`),
the memory that takes foreseen (`budget`, `memory`), and the checks of what was written
(`validate`, `inspect`, `ane_rules`). `llama_ane.export_model` drives it.
"""
