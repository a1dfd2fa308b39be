"""The network, one file per exported model kind: `embeddings`, `chunk` (decoder layers, with the
cascade's branch function and the verify window), `lm_head` and `cache_update`, with the decoder
layers themselves in `layers`, one file per layer kind over shared ops. In each file the torch
module (the reference the torch backend runs) and its MIL builder (what the exporter saves) stand
side by side, and the kind declares the I/O of each of its functions (`functions`, from a
`functions.Layout`). Importing this package does not import coremltools: the builders load it when
they first run."""
