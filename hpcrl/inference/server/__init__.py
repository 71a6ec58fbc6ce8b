"""hpcrl's CPU inference server: SGLang's HTTP API over a Hugging Face model, with dynamic batching.

``python -m hpcrl.inference.server --model-path DIR --host H --port N``. It stands in for SGLang where
SGLang cannot run (CPU machines, CI) and is the default server of the tiny job. It holds requests to
SGLang 0.5.23's contract (``app.py``, ``weights.py``, ``requests.py``), and with ``--tp-size N`` runs
N-1 more ranks of the weight-update group as child processes (``tp_ranks.py``, ``tp_rank.py``).
"""
