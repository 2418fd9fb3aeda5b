"""Distribution applied from outside the model: process groups, DDP/FSDP wrapping, sharded tables.

``trainer.DistributedTrainer`` is the training loop's ``Trainer`` with its seams filled in for one
rank of a ``torchrun`` job; ``stemlm.train.train`` picks it when ``WORLD_SIZE > 1``.
"""
