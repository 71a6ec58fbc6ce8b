"""Inference: how a request reaches a server.

    client.py        InferenceClient: load balancing, deadlines, bounded retries, pause/continue, weight updates
    client_http.py   its HTTP pool (aiohttp) and errors; client_wire.py: request checks and response parsing
    context.py       a model's context length as SGLang reads it; options.py: a run's client settings
    server/          hpcrl's CPU server, speaking SGLang's HTTP API (``python -m hpcrl.inference.server``)
    sglang.py        the SGLang launch command and environment; commands.py: the command of either backend
    sglang_api.py    the SGLang release hpcrl is tested with and the endpoints it calls
    serve.py         start a server process and wait until it answers; worker.py: the server worker process
    weight_group.py  the weight-update process group (the only part ``train/`` uses); weight_layout.py: its
                     rank arithmetic and a push's buckets, without torch

``inference/`` imports nothing of ``rollout/`` or ``controller/`` (tests/test_layout.py).
"""
