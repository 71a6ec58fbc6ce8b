"""Rollout: what an episode does, and where episodes run.

    executor.py        the staleness-bounded rollout executor
    workflows/         one module per workflow (single turn, multi-turn, scaffolds); the factory in __init__
    episode_worker.py  a rollout worker process serving episodes over RPC; remote.py: the controller's side

Uses ``inference/`` (the client of the servers), never the reverse.
"""
