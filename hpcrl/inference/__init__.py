"""Inference: how a request reaches a server.

    client.py        InferenceClient: load balancing, deadlines, bounded retries, pause/continue, weight updates
    client_http.py   its HTTP pool (aiohttp) and errors; client_wire.py: request checks and response parsing
    server/          hpcrl's CPU server, speaking SGLang's HTTP API (``python -m hpcrl.inference.server``)
    sglang.py        the SGLang launch command and environment; commands.py: the command of either backend
    serve.py         start a server process and wait until it answers; worker.py: the server worker process
    weight_group.py  the weight-update process group (the only part ``train/`` uses)

``inference/`` imports nothing of ``rollout/`` or ``controller/`` (tests/test_layout.py).
"""
