"""Rollout: what an episode does, and where episodes run.

    executor.py        the staleness-bounded rollout executor
    workflows/         one module per workflow (single turn, multi-turn, scaffolds, plug-ins); the factory in __init__
    proxy/             the per-episode OpenAI endpoint of plug-in workflows, recording every completion's tokens
    agents/            example agents written against the openai client, and their evaluation without hpcrl's loop
    episode_worker.py  a rollout worker process serving episodes over RPC; remote.py: the controller's side

Uses ``inference/`` (the client of the servers), never the reverse.
"""
