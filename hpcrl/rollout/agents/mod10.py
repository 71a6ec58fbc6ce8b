"""The default task ("a+b=" -> (a+b) mod 10) as an agent with a calculator: ``experiment=mod10_agent``.

Written against the ``openai`` client only, as an agent for a deployed model would be: it asks the model the
question with the calculator among its tools; if the model calls it, the agent runs it and sends the result
back as a tool message, and asks again (no tools this time: one call at most); the model's last answer gets the
task's reward (``ep.score``: the run's ``reward.fn``). hpcrl records every completion through the episode's
endpoint and trains on them (docs/agents.md). The same function runs against any OpenAI-compatible server
(``hpcrl/rollout/agents/evaluate.py``).

The calculator evaluates the expression the call names, or the question itself when the call names none: the
tiny model's one-token call (``?``, the ``tiny`` tool parser) has no arguments.
"""

from __future__ import annotations

import json
import re

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Adds two digits modulo 10: '3+9' gives '2'. Without an expression it answers the question.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "two digits joined by +, e.g. 3+9"}},
        },
    },
}
_SUM = re.compile(r"^\s*(\d+)\s*\+\s*(\d+)\s*=?\s*$")


def calculate(expression: str) -> str:
    """The calculator: ``"a+b"`` -> ``str((a + b) % 10)``; anything else -> an error message for the model."""
    match = _SUM.match(expression)
    if not match:
        return "error"
    return str((int(match[1]) + int(match[2])) % 10)


async def calculator_agent(ep) -> float:  # ep: hpcrl.rollout.workflows.base.EpisodeContext
    """Ask, run the calculator if the model calls it, ask again; the reward of the final answer."""
    messages: list = [{"role": "user", "content": ep.prompt}]
    reply = await ep.client.chat.completions.create(
        model=ep.model, messages=messages, tools=[CALCULATOR], **ep.sampling
    )
    message = reply.choices[0].message
    if message.tool_calls:
        call = message.tool_calls[0]
        arguments = json.loads(call.function.arguments or "{}")
        result = calculate(arguments.get("expression") or ep.prompt)
        messages += [message, {"role": "tool", "tool_call_id": call.id, "content": result}]
        reply = await ep.client.chat.completions.create(model=ep.model, messages=messages, **ep.sampling)
        message = reply.choices[0].message
    return await ep.score(message.content or "")
