"""Plug-in workflows by name (``hpcrl/rollout/workflows/plugin.py``): ``workflow.name=module:function`` (or
``module:Class``) from a module outside the package resolves by import, and everything else is refused with one
line naming the spec and what failed; the config refuses a bad name, chat template or tool parser before any of it."""

import asyncio
import textwrap
import uuid

import pytest

from hpcrl.config import ConfigError
from hpcrl.config.preflight import preflight
from hpcrl.controller.job import prepare_rows
from hpcrl.data.files import DataError
from hpcrl.inference.openai.templates import TINY_TOOLS
from hpcrl.models.tiny import make_tokenizer
from hpcrl.rollout.agents.mod10 import calculator_agent
from hpcrl.rollout.workflows import make_workflow
from hpcrl.rollout.workflows.agent import AgentWorkflow
from hpcrl.rollout.workflows.plugin import WorkflowSpecError, is_plugin, resolve
from tests.config.compose import load

FLOWS = """
    import json

    VALUE = 3


    async def agent(ep):
        return 1.0


    def helper(x):
        return x


    def _private():
        pass


    class Agent:
        built = 0

        def __init__(self):
            Agent.built += 1

        async def __call__(self, ep):
            return 0.5


    agent_object = Agent()


    class NeedsArguments:
        def __init__(self, model):
            self.model = model

        async def __call__(self, ep):
            return 0.0


    class SyncAgent:
        def __call__(self, ep):
            return 0.0
"""


@pytest.fixture
def package(tmp_path, monkeypatch):
    """A package of its own name under tmp_path (not under hpcrl), on sys.path: ``<name>.flows`` holds FLOWS."""
    name = f"mytasks_{uuid.uuid4().hex[:8]}"
    (tmp_path / name).mkdir()
    (tmp_path / name / "__init__.py").write_text("")
    (tmp_path / name / "flows.py").write_text(textwrap.dedent(FLOWS))
    (tmp_path / name / "broken.py").write_text("import json\nraise RuntimeError('needs a GPU to import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def test_a_function_from_a_module_outside_the_package_resolves_to_itself(package, tmp_path):
    episode = resolve(f"{package}.flows:agent")
    module = __import__(f"{package}.flows", fromlist=["agent"])
    assert episode is module.agent and module.__file__ == str(tmp_path / package / "flows.py")
    assert asyncio.run(episode(None)) == 1.0


def test_a_class_resolves_to_an_instance_built_with_no_arguments(package):
    episode = resolve(f"{package}.flows:Agent")
    module = __import__(f"{package}.flows", fromlist=["Agent"])
    assert type(episode) is module.Agent and module.Agent.built == 2  # the module's own instance, then this one
    assert asyncio.run(episode(None)) == 0.5
    assert resolve(f"{package}.flows:agent_object") is module.agent_object  # an instance: used as it is


@pytest.mark.parametrize(
    ("attr", "words"),
    [
        ("helper", "{p}.flows.helper is not an async function; expected `async def episode(ep: EpisodeContext)"),
        ("SyncAgent", "{p}.flows.SyncAgent is not an async function"),
        ("VALUE", "{p}.flows.VALUE is not an async function"),
        ("NeedsArguments", "the class NeedsArguments could not be built with no arguments: TypeError: "),
        ("agnet", "has no attribute 'agnet'; its public callables are: Agent, NeedsArguments, SyncAgent, agent, "),
    ],
)
def test_what_is_not_an_async_episode_function_is_refused_naming_it(package, attr, words):
    spec = f"{package}.flows:{attr}"
    with pytest.raises(WorkflowSpecError) as refused:
        resolve(spec)
    message = str(refused.value)
    assert message.startswith(f"workflow.name={spec!r}: ") and words.format(p=package) in message
    assert "\n" not in message


def test_the_missing_attribute_error_lists_only_public_callables(package):
    with pytest.raises(WorkflowSpecError) as refused:
        resolve(f"{package}.flows:agnet")
    listed = str(refused.value).split("its public callables are: ")[1].split(", ")
    assert listed == ["Agent", "NeedsArguments", "SyncAgent", "agent", "agent_object", "helper"]
    assert f"{package}/flows.py" in str(refused.value), "the module's file, so a stale copy on the path shows"


def test_a_module_that_does_not_import_is_named_with_the_cause(package):
    with pytest.raises(WorkflowSpecError) as refused:
        resolve(f"{package}.broken:agent")
    assert f"cannot import module '{package}.broken': RuntimeError: needs a GPU to import." in str(refused.value)
    assert isinstance(refused.value.__cause__, RuntimeError)
    with pytest.raises(WorkflowSpecError) as missing:
        resolve("nosuch_tasks_pkg.flows:agent")
    message = str(missing.value)
    assert (
        "cannot import module 'nosuch_tasks_pkg.flows': ModuleNotFoundError: No module named 'nosuch_tasks_pkg'"
        in message
    )
    assert "installed, or on PYTHONPATH" in message


@pytest.mark.parametrize("spec", ["__main__:agent", "__mp_main__:agent"])
def test_a_function_in_main_is_refused_because_other_processes_cannot_import_it(spec):
    with pytest.raises(WorkflowSpecError, match="a function in __main__ cannot be imported by the processes"):
        resolve(spec)


@pytest.mark.parametrize(
    "spec",
    ["mytasks.flows:", ":agent", "my-tasks.flows:agent", "mytasks..flows:agent", "mytasks.flows:agent:x", "a b:c"],
)
def test_a_spec_not_of_the_form_module_colon_function_is_refused(spec):
    with pytest.raises(WorkflowSpecError) as refused:
        resolve(spec)
    assert str(refused.value) == (
        f"workflow.name={spec!r} is not of the form 'package.module:function', "
        "e.g. 'hpcrl.rollout.agents.mod10:calculator_agent'"
    )


def test_a_plugin_is_a_name_with_a_colon():
    assert is_plugin("mytasks.flows:agent") and not is_plugin("single_turn") and not is_plugin("multi_turn")


@pytest.mark.parametrize(
    ("override", "path", "expected"),
    [
        ("workflow.name='bad name'", "workflow.name", "one of single_turn, multi_turn, best_of_n"),
        ("workflow.name='my tasks:agent'", "workflow.name", "a built-in workflow or 'package.module:function'"),
        ("workflow.name=mytasks.flows:", "workflow.name", "a built-in workflow or 'package.module:function'"),
        ("workflow.chat_template=chatml", "workflow.chat_template", '"", one of tiny_tools, or a .jinja file'),
        ("workflow.tool_parser=xml", "workflow.tool_parser", "one of hermes, tiny, none"),
        ("workflow.turn_discount=0", "workflow.turn_discount", "a number in (0, 1]"),
    ],
)
def test_the_config_refuses_a_bad_plugin_setting_in_one_line(override, path, expected):
    with pytest.raises(ConfigError) as refused:
        load(override)
    assert refused.value.path == path and expected in refused.value.expected
    assert str(refused.value).startswith(f"{path}=") and "\n" not in str(refused.value)


def test_the_config_takes_a_plugin_it_has_not_imported_and_make_workflow_builds_it():
    assert load("workflow.name=mytasks.flows:agent").workflow.name == "mytasks.flows:agent"  # imported at start
    cfg = load("experiment=mod10_agent", "workflow.turn_discount=0.5")
    resumed = asyncio.Event()
    workflow = make_workflow(cfg, None, make_tokenizer(), None, resumed)  # type: ignore[arg-type]
    assert isinstance(workflow, AgentWorkflow) and workflow.episode is calculator_agent
    assert (workflow.chat.template, workflow.chat.tool_parser) == (TINY_TOOLS, "tiny")
    assert (workflow.turn_discount, workflow.group_size) == (0.5, cfg.algorithm.group_size)
    assert workflow.sampling["max_new_tokens"] == 1 and workflow.name == "hpcrl.rollout.agents.mod10:calculator_agent"


def test_a_plugin_refuses_the_dataset_template_and_a_missing_jinja_file(tmp_path):
    """The agent's messages are templated by its proxy: dataset.chat_template=true would template the prompt
    first (twice in all); a .jinja template that is not there fails before anything starts, not in a worker."""
    with pytest.raises(ConfigError) as refused:
        load("workflow.name=mytasks.flows:agent", "dataset.chat_template=true")
    assert refused.value.path == "dataset.chat_template" and "plug-in" in refused.value.expected
    missing = tmp_path / "agent.jinja"
    with pytest.raises(ConfigError) as refused:
        preflight(load("workflow.name=mytasks.flows:agent", f"workflow.chat_template={missing}"))
    assert refused.value.path == "workflow.chat_template" and str(missing) in refused.value.expected


def test_a_plugin_gets_each_prompt_as_written_and_conversation_rows_are_refused():
    cfg = load("experiment=mod10_agent", "dataset.chat_template=auto")
    rows = [{"prompt": "3+4=", "answer": "7"}], [{"prompt": "1+2=", "answer": "3"}]
    assert prepare_rows(cfg, *rows) == rows  # untouched: no template, whatever the tokenizer has
    conversation = {"prompt": "", "messages": '[{"role": "user", "content": "3+4="}]', "answer": "7"}
    with pytest.raises(DataError, match=r"^row 1 is a conversation .* a plug-in workflow takes string prompts"):
        prepare_rows(cfg, [rows[0][0], conversation], [])
