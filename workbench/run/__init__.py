"""What a peer process runs: the round loop (:mod:`.peer`), a torchrun node (:mod:`.node`),
model, data and Hugging Face loaders, the shared training setup, checkpoints, exporters."""
