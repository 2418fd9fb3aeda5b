"""Distribution applied from outside the model: process groups, DDP/FSDP wrapping, sharded tables."""
