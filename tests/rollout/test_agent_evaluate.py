"""The example agent (``hpcrl.rollout.agents.mod10:calculator_agent``) evaluated without hpcrl's loop, as
``python -m hpcrl.rollout.agents.evaluate`` against the CPU server's OpenAI routes, and through hpcrl's proxy
(``AgentWorkflow.accuracy``): both print the accuracy of the greedy answers computed here from the server's own
``/generate``, the calculator's result sent back where the model called it."""

import json
import socket
import subprocess
import sys

from hpcrl.config.load import dump_config
from hpcrl.data import load_splits, make_mod10
from hpcrl.inference.openai.chat import ChatFormat
from hpcrl.models.tokenizer import load_tokenizer
from hpcrl.reward.builtin import mod10
from hpcrl.reward.outcome import RewardOutcome
from hpcrl.rollout.agents.evaluate import DEFAULT_AGENT, DEFAULT_REWARD, parse_args, settings
from hpcrl.rollout.agents.mod10 import calculator_agent
from hpcrl.rollout.workflows.agent import AgentWorkflow
from tests.config.compose import load
from tests.conftest import REPO, user_error
from tests.rollout.test_multi_turn import Recording, resumed_event, run

ROWS = 100  # held-out rows of the default task (run.seed 0): enough that the calculator's result decides some


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def greedy_answers(server, rows: list[dict[str, str]], shift: int = 0) -> tuple[list[str], list[list[int]]]:
    """The agent's final answer to each row, greedily, from /generate (tiny_tools: a turn is its bare text, a call is
    ``?`` and a tool result is followed by ``=``); and every prompt the agent sends. The calculator answers the
    question itself, (a + b) mod 10: the row's answer (plus ``shift``, a calculator that is wrong)."""
    tokenizer = load_tokenizer(server.model)
    greedy = {"max_new_tokens": 1, "temperature": 0.0}
    prompts = [ids(tokenizer, r["prompt"]) for r in rows]
    first = server.generate_many([{"input_ids": p, "sampling_params": greedy} for p in prompts])
    called = [i for i, answer in enumerate(first) if answer["output_ids"] == ids(tokenizer, "?")]
    results = {i: str((int(rows[i]["answer"]) + shift) % 10) for i in called}
    again = [ids(tokenizer, f"{rows[i]['prompt']}?{results[i]}=") for i in called]
    second = server.generate_many([{"input_ids": p, "sampling_params": greedy} for p in again]) if again else []
    final = [a["output_ids"] for a in first]
    for i, answer in zip(called, second, strict=True):
        final[i] = answer["output_ids"]
    return [tokenizer.decode(out, skip_special_tokens=True) for out in final], prompts + again


def accuracy_of(rows, answers) -> float:
    return sum(mod10(r["prompt"], a, r["answer"]) for r, a in zip(rows, answers, strict=True)) / len(rows)


def expected_accuracy(server, rows) -> tuple[float, list[list[int]]]:
    """The greedy answers' accuracy and the prompts sent; the test is only as good as these answers are telling."""
    answers, sent = greedy_answers(server, rows)
    assert len(rows) < len(sent) < 2 * len(rows), "some rows must call the calculator, and some not"
    wrong, _ = greedy_answers(server, rows, shift=1)
    assert accuracy_of(rows, wrong) != accuracy_of(rows, answers), "a wrong calculator result must show"
    return accuracy_of(rows, answers), sent


def held_out(size: int = ROWS, seed: int = 0) -> list[dict[str, str]]:
    return [{"prompt": r["prompt"], "answer": r["answer"]} for r in make_mod10(0, size, seed)[1]]


def test_the_standalone_evaluation_prints_the_accuracy_of_the_greedy_answers(agent_server):
    expected, _ = expected_accuracy(agent_server, held_out())
    cmd = [sys.executable, "-m", "hpcrl.rollout.agents.evaluate", "--base-url", f"{agent_server.url}/v1"]
    result = subprocess.run([*cmd, "--eval-size", str(ROWS)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    [line] = result.stdout.splitlines()
    printed = json.loads(line)
    assert printed == {"accuracy": expected, "rows": ROWS, "agent": DEFAULT_AGENT, "base_url": f"{agent_server.url}/v1"}


class Greedy(Recording):
    """The real client; ``params`` holds the sampling parameters of every generate."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.params = []

    async def generate(self, input_ids, sampling_params, **kwargs):
        self.params.append(dict(sampling_params))
        return await super().generate(input_ids, sampling_params, **kwargs)


class Mod10Rewards:
    """reward.fn=hpcrl.reward.builtin:mod10, scored in this process."""

    async def score(self, items):
        return [RewardOutcome(mod10(*item[:3])) for item in items]


def test_the_same_agent_through_hpcrls_proxy_has_the_same_held_out_accuracy(agent_server):
    rows = held_out()
    tokenizer = load_tokenizer(agent_server.model)
    sampling = {"max_new_tokens": 1, "temperature": 1.0, "top_p": 1.0, "top_k": -1}  # evaluation is greedy anyway

    async def accuracy():
        async with Greedy([agent_server.address], max_retries=0) as client:
            chat = ChatFormat(tokenizer, "tiny_tools", "tiny")
            workflow = AgentWorkflow(
                calculator_agent, client, tokenizer, chat, sampling, 8, Mod10Rewards(), resumed_event()
            )
            try:
                return (await workflow.accuracy(rows), client.params), client.calls
            finally:
                await workflow.aclose()

    (measured, params), calls = run(accuracy())
    expected, sent = expected_accuracy(agent_server, rows)
    assert measured == expected
    assert sorted(prompt for prompt, _ in calls) == sorted(sent), (
        "the questions, and the tool results as the template writes them"
    )
    assert {p["temperature"] for p in params} == {0.0}, "every request greedy"


def test_a_run_directory_gives_the_agent_reward_rows_and_sampling_of_the_runs_own_evaluation(tmp_path):
    cfg = load("experiment=mod10_agent", "dataset.eval_size=7", "run.seed=3", "rollout.stop=['=']")
    (tmp_path / "config.yaml").write_text(dump_config(cfg))
    agent, reward, _, rows, sampling = settings(parse_args(["--base-url", "http://x/v1", "--run-dir", str(tmp_path)]))
    assert (agent, reward) == (cfg.workflow.name, cfg.reward.fn) == (DEFAULT_AGENT, DEFAULT_REWARD)
    assert rows == [{"prompt": r["prompt"], "answer": r["answer"]} for r in load_splits(cfg.dataset, 3)[1]]
    assert len(rows) == 7 and rows == held_out(7, 3)
    assert sampling == {"temperature": 0.0, "top_p": 1.0, "max_tokens": 1, "stop": ["="]}
    args = parse_args(
        ["--base-url", "http://x/v1", "--max-tokens", "4", "--agent", "mytasks:agent", "--eval-size", "5"]
    )
    agent, reward, _, rows, sampling = settings(args)
    assert (agent, reward, len(rows), sampling) == (
        "mytasks:agent",
        DEFAULT_REWARD,
        5,
        {"temperature": 0.0, "max_tokens": 4},
    )


def evaluate_cli(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "hpcrl.rollout.agents.evaluate", "--eval-size", "3", *args]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)


def test_no_server_at_the_url_is_one_line_with_how_to_start_one():
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}/v1"
    # before: 109 lines of openai's and httpx's tracebacks, and no word of a server to start
    line, hint = user_error(evaluate_cli("--base-url", url))
    assert line == f"hpcrl: no server answers at {url} (All connection attempts failed)"
    assert hint.strip().startswith("start one, e.g. python -m hpcrl.inference.server --model-path RUN_DIR/final")


def test_a_url_that_is_not_the_servers_openai_api_is_one_line(agent_server):
    line, hint = user_error(evaluate_cli("--base-url", agent_server.url))  # without /v1
    assert line == (
        f"hpcrl: the server at {agent_server.url} has no OpenAI API there (404 Not Found): --base-url is the API's "
        "base, e.g. http://HOST:PORT/v1"
    )
    assert "--base-url http://127.0.0.1:30000/v1" in hint


def test_a_run_directory_without_a_config_is_one_line(tmp_path):
    (line,) = user_error(evaluate_cli("--base-url", "http://127.0.0.1:1/v1", "--run-dir", str(tmp_path)))
    assert line.startswith(f"hpcrl: config error: {tmp_path}/config.yaml='<file>' is invalid: expected a readable")
