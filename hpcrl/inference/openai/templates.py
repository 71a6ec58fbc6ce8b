"""Chat templates hpcrl ships, by name (``workflow.chat_template``, the CPU server's ``--chat-template``).

``tiny_tools``: the tiny model's agent template (``experiment=mod10_agent``). A conversation is written with no
role markers: the user's text, then each assistant turn as its text, a tool call as ``?`` (the ``tiny`` tool
parser's one-token call), and each tool result followed by ``=``::

    [user "3+4="]                                     -> "3+4="        the model answers "7", or calls: "?"
    [user "3+4=", assistant call, tool "7"]           -> "3+4=?7="     the model answers "7"

Nothing is added after a model's turn, so the next turn's prompt extends the last one token for token when
the model's turn is one token (``rollout.max_new_tokens=1``): the whole exchange trains as one trajectory. The
template adds only ``?`` and ``=`` to the task's alphabet. Why a template this small: docs/agents.md.
"""

from __future__ import annotations

TINY_TOOLS = (
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}{{ m.content }}{%- if m.tool_calls -%}?{%- endif -%}"
    "{%- elif m.role == 'tool' -%}{{ m.content }}="
    "{%- else -%}{{ m.content }}"
    "{%- endif -%}"
    "{%- endfor -%}"
)

TEMPLATES = {"tiny_tools": TINY_TOOLS}
