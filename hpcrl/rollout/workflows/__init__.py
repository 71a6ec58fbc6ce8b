"""The workflow an episode runs, chosen by ``workflow.name``: the one place that builds workflows.

    workflow = make_workflow(cfg, client, tokenizer, rewards, resumed, host=..., ports=...)
    group = await workflow.run(prompt, answer)      # episodes run concurrently on this one object
    await close_workflow(workflow)                  # a plug-in's proxy stops listening

Used by the controller and by rollout workers alike, so both run the same episode for the same config.
``workflow.name`` is a built-in name, or ``module:function`` (``module:Class``): a plug-in episode function,
imported in this process (``plugin.py``) and run through a per-episode OpenAI endpoint (``agent.py``), which
listens on ``host`` (a loopback address) at a port of ``ports``, this process's slice.

    base.py         Sample, Group, the Workflow and Rewarder interfaces, the episode contract, the sampling parameters
    single_turn.py  SingleTurn: one completion per sample (the default)
    multi_turn.py   MultiTurn: answer, feedback, answer again
    scaffold.py     Generate, BestOfN, MajorityVote, Pipeline: scaffolds for evaluation and as rollout
    plugin.py       resolving ``module:function`` plug-ins; agent.py: AgentWorkflow, a plug-in as a workflow
"""

from __future__ import annotations

import asyncio
from typing import Any

from hpcrl.config.schema import Config
from hpcrl.inference.client import InferenceClient
from hpcrl.net import PortAllocator
from hpcrl.rollout.workflows.base import Rewarder, Workflow, behaviour_logprobs, sampling_params
from hpcrl.rollout.workflows.plugin import is_plugin
from hpcrl.rollout.workflows.single_turn import SingleTurn

WORKFLOWS = ("single_turn", "multi_turn", "best_of_n", "majority_vote", "pipeline")
SCAFFOLDS = ("best_of_n", "majority_vote", "pipeline")  # scaffolding controllers run as rollout (scaffold.py)


def make_workflow(
    cfg: Config,
    client: InferenceClient,
    tokenizer: Any,
    rewards: Rewarder,
    resumed: asyncio.Event,
    *,
    host: str = "127.0.0.1",  # a plug-in's proxy: the loopback address of the run's family
    ports: PortAllocator | None = None,  # ... and this process's port slice (None: any free port)
) -> Workflow:
    """The workflow ``cfg.workflow.name`` names, with the rollout's sampling parameters on every request; it asks the
    servers for the sampled tokens' logprobs unless ``algorithm.behaviour_logprobs=recompute``."""
    name = cfg.workflow.name
    sampling = sampling_params(cfg.rollout)
    if is_plugin(name):
        from hpcrl.rollout.workflows.agent import agent_workflow

        return agent_workflow(cfg, client, tokenizer, sampling, rewards, resumed, host=host, ports=ports)
    if name == "single_turn":
        return SingleTurn(
            client, tokenizer, sampling, cfg.algorithm.group_size, rewards, resumed,
            max_empty_aborts=cfg.rollout.max_empty_aborts, logprobs=behaviour_logprobs(cfg),
        )  # fmt: skip
    if name == "multi_turn":
        from hpcrl.rollout.workflows.multi_turn import MultiTurn

        w = cfg.workflow
        return MultiTurn(
            client, tokenizer, sampling, cfg.algorithm.group_size, rewards, resumed,
            max_turns=w.max_turns, turn_discount=w.turn_discount, feedback=w.feedback,
            max_empty_aborts=cfg.rollout.max_empty_aborts, logprobs=behaviour_logprobs(cfg),
        )  # fmt: skip
    if name in SCAFFOLDS:
        from hpcrl.rollout.workflows.scaffold import scaffold_workflow

        return scaffold_workflow(cfg, client, tokenizer, sampling, rewards, resumed)
    raise ValueError(f"workflow.name={name!r} is invalid: expected one of {', '.join(WORKFLOWS)}, or module:function")


async def close_workflow(workflow: Any) -> None:
    """Release what a workflow holds that needs the event loop (a plug-in's proxy); a no-op for the others."""
    aclose = getattr(workflow, "aclose", None)
    if aclose is not None:
        await aclose()
