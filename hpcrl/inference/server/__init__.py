"""hpcrl's CPU inference server: SGLang's HTTP API over a Hugging Face model, with dynamic batching.

``python -m hpcrl.inference.server --model-path DIR --host H --port N``. It stands in for SGLang where
SGLang cannot run (CPU machines, CI) and is the default server of the tiny job.
"""
