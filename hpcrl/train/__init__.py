"""Training: the torchrun FSDP2 worker and engine, algorithms, micro-batching, checkpoints, weight push.

The same worker runs the critic of PPO with a learned critic (``--role critic``): ``value_engine.py`` shards
``value_model.py`` (the policy's backbone with a scalar value head) like the policy, ``critic_service.py``
serves it, and ``algorithms/gae.py`` and ``algorithms/value.py`` hold GAE and the clipped value loss.
``lora.py`` wraps the policy with peft's LoRA adapters (``train.lora``): only they train, and they leave the
trainer in PEFT's layout; ``lora_reference.py`` is the KL reference then (the adapters off).
"""
