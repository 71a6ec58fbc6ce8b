"""The OpenAI-compatible API, as SGLang 0.5.23 serves it: the request bodies, the chat rendering and the answers.

    protocol.py    /v1/completions and /v1/chat/completions bodies, checked field by field as SGLang's request
                   classes name them; answers and errors in SGLang's (and OpenAI's) shape
    chat.py        messages (and tools) to a prompt with a chat template; a turn's text to content and tool calls
    templates.py   chat templates hpcrl ships (``tiny_tools``: the tiny model's agent template)

Used by hpcrl's CPU server (``server/openai_routes.py``) and by the rollout's per-episode proxy
(``hpcrl/rollout/proxy``), so that an agent sees one API in both. Nothing here imports torch.
"""
