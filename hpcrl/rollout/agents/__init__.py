"""Example agents: episode functions written against the ``openai`` client only (``workflow.name=module:function``).

mod10.py      calculator_agent: the default task, with a calculator the model may call once
evaluate.py   ``python -m hpcrl.rollout.agents.evaluate``: an agent against any OpenAI-compatible server
              (hpcrl's CPU server, SGLang), without hpcrl's loop
"""
