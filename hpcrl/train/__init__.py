"""Training: the torchrun FSDP2 worker and engine, algorithms, micro-batching, checkpoints, weight push."""
