"""Training: the torchrun FSDP2 worker and engine, algorithms, micro-batching, checkpoints, weight push.

``value_model.py`` (a critic: the policy's backbone with a scalar value head) and the GAE and value-loss
functions in ``algorithms/gae.py`` and ``algorithms/value.py`` are the first layer of PPO with a learned
critic (issue 23); no role, config field or loop uses them yet.
"""
