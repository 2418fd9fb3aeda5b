"""The checkpoint format every package reads and writes: ``directory`` (a checkpoint directory:
``config.json``, ``model.safetensors``, written atomically and loaded without executing code),
``integrity`` (its checksum manifest, NaN/inf refusal) and ``safetensors_io`` (safetensors files
streamed by rows and memory-mapped, for checkpoints and tables files)."""
