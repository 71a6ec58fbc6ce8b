"""A reward model (a sequence-classification head) on the CPU server, scored through SGLang 0.5.23's ``/classify``.

A real server process serves a tiny Qwen2ForSequenceClassification made here from a config; its scores are
compared with the model's own forward pass, its bodies and answers with what SGLang's wheel declares
(``sglang_wheel.py``), and its refusals with SGLang's (``hpcrl/inference/server/classify.py``).
"""

import ast
import json

import pytest
import torch

from hpcrl.inference.server.classify import GENERATE_REFUSED, NOT_EMBEDDING, reward_model_kind
from hpcrl.models.tiny import make_tokenizer, qwen2_config
from hpcrl.models.tokenizer import mark_exact
from tests.inference.conftest import ServerProc
from tests.inference.sglang_wheel import Wheel, fetch_wheel, fields_of

BATCH = [[5, 6, 7, 8, 9], [12, 40], [3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 20]]  # no pad id (0): transformers' pooling
TEXTS = ["2+3=5", "2+3=6"]


def make_reward_model(out, seed: int = 0):
    """A tiny Qwen2 with a one-label score head (a reward model), and the character tokenizer, saved to ``out``."""
    from transformers import AutoModelForSequenceClassification

    tokenizer = make_tokenizer()
    config = qwen2_config(tokenizer, 64, 2, 4, 256)
    config.num_labels = 1
    config.architectures = ["Qwen2ForSequenceClassification"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    mark_exact(out)
    return out


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory):
    return make_reward_model(tmp_path_factory.mktemp("reward-model"))


@pytest.fixture(scope="module")
def reward_server(reward_model, tmp_path_factory):
    """Started without --is-embedding: SGLang recognises the class by its architecture."""
    proc = ServerProc(reward_model, tmp_path_factory.mktemp("reward-server") / "server.log")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def wheel() -> Wheel:
    return Wheel(fetch_wheel())


def own_scores(model_dir, batch: list[list[int]]) -> list[list[float]]:
    """The model's own forward, one unpadded prompt at a time."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    with torch.inference_mode():
        return [model(torch.tensor([ids])).logits[0].tolist() for ids in batch]


def test_a_batch_scores_as_the_models_own_forward_with_sglangs_answer(reward_server, reward_model):
    status, answer = reward_server.post("/classify", {"input_ids": BATCH, "rid": ["a", "b", "c"]})
    assert status == 200, answer
    expected = own_scores(reward_model, BATCH)
    assert [len(a["embedding"]) for a in answer] == [1, 1, 1]
    for got, want in zip(answer, expected, strict=True):
        assert got["embedding"] == pytest.approx(want, abs=1e-5)
    assert [a["meta_info"]["id"] for a in answer] == ["a", "b", "c"]
    assert [a["meta_info"]["prompt_tokens"] for a in answer] == [5, 2, 11]
    assert answer[0]["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    status, single = reward_server.post("/classify", {"input_ids": BATCH[1]})
    assert status == 200 and single["embedding"] == pytest.approx(expected[1], abs=1e-5)


def test_the_head_reads_the_last_token_even_when_it_is_the_pad_id(reward_server, reward_model):
    """SGLang pools the last position; transformers' own pooling skips trailing pad ids (0 here)."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(reward_model).eval()
    ids = [5, 6, 0, 0]
    with torch.inference_mode():
        last = model.score(model.model(torch.tensor([ids])).last_hidden_state[:, -1])[0].tolist()
        transformers_own = model(torch.tensor([ids])).logits[0].tolist()
    status, answer = reward_server.post("/classify", {"input_ids": ids})
    assert status == 200 and answer["embedding"] == pytest.approx(last, abs=1e-5)
    assert transformers_own != pytest.approx(last, abs=1e-5)  # the two poolings differ on this prompt


def test_text_is_tokenized_and_scored_as_its_ids(reward_server, reward_model):
    from hpcrl.models.tokenizer import load_tokenizer

    ids = [load_tokenizer(reward_model)(t)["input_ids"] for t in TEXTS]
    status, answer = reward_server.post("/classify", {"text": TEXTS})
    assert status == 200, answer
    expected = own_scores(reward_model, ids)
    assert [a["embedding"] for a in answer] == [pytest.approx(e, abs=1e-5) for e in expected]
    assert [a["meta_info"]["prompt_tokens"] for a in answer] == [5, 5]


def test_model_info_and_health_of_a_reward_model(reward_server):
    _, info = reward_server.get("/model_info")
    assert info["is_generation"] is False and info["weight_version"] == "default"
    assert reward_server.get("/health")[0] == 200


@pytest.mark.parametrize(
    "body, message",
    [
        ({"input_ids": [1, 2], "text": "1"}, "text and input_ids cannot be provided at the same time"),
        ({"rid": "x"}, "At least one of text, input_ids"),
        ({"text": []}, "text must be a string or a non-empty list of strings"),
        ({"input_ids": [[4, 5], [6]], "rid": ["r", "r"]}, "Duplicate request IDs detected within the request"),
        ({"input_ids": [[4, 5], [6]], "rid": "r"}, "The rid should be a list."),
        ({"input_ids": [4, 10_000]}, "input_ids[1]=10000 is not a token id"),
        ({"input_ids": [4], "sampling_params": {}}, "unsupported field(s) ['sampling_params']"),
        ({"input_ids": [4] * 600}, "longer than the model's context length"),
    ],
)
def test_bad_classify_bodies_are_refused(reward_server, body, message):
    status, answer = reward_server.post("/classify", body)
    assert status == 400 and message in answer["error"]["message"], answer


def test_generate_on_a_reward_model_and_classify_on_a_generation_model_are_refused(reward_server, server, wheel):
    assert reward_server.post("/generate", {"input_ids": [4, 5]}) == (400, {"error": {"message": GENERATE_REFUSED}})
    assert server.post("/classify", {"input_ids": [4, 5]}) == (400, {"error": {"message": NOT_EMBEDDING}})
    source = wheel.source("srt/managers/tokenizer_manager.py")
    assert json.dumps(NOT_EMBEDDING.split(". ")[0]).strip('"') in source  # SGLang's own words


def test_bodies_and_answers_are_sglangs(reward_server, wheel):
    """The route, its request class and the answer's keys, as SGLang 0.5.23's wheel declares them."""
    from pydantic import TypeAdapter

    routes = wheel.routes()
    assert "POST" in routes["/classify"]["methods"] and routes["/classify"]["body"] == "EmbeddingReqInput"
    cls = wheel.io_struct(["EmbeddingReqInput"]).EmbeddingReqInput
    bodies = [{"input_ids": BATCH, "rid": ["a", "b", "c"]}, {"input_ids": BATCH[0]}, {"text": TEXTS}, {"text": "1+1"}]
    for body in bodies:
        TypeAdapter(cls).validate_python(body)
        assert set(body) <= fields_of(cls)
        status, answer = reward_server.post("/classify", body)
        assert status == 200
        for one in answer if isinstance(answer, list) else [answer]:
            assert set(one) == {"embedding", "meta_info"}
            assert set(one["meta_info"]) == sglang_embedding_meta_info(wheel)


def sglang_embedding_meta_info(wheel) -> set[str]:
    """The keys of an embedding answer's ``meta_info`` in SGLang's ``_handle_batch_output`` (metrics off): the
    dict it starts with, and ``e2e_latency`` set when the request finishes."""
    source = wheel.source("srt/managers/tokenizer_manager.py")
    tree = ast.parse(source)
    method = next(n for n in ast.walk(tree) if isinstance(n, ast.AsyncFunctionDef) and n.name == "_handle_batch_output")
    first = next(
        n.value
        for n in ast.walk(method)
        if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "meta_info" and isinstance(n.value, ast.Dict)
    )
    assert "meta_info['e2e_latency']" in ast.unparse(method)
    return {k.value for k in first.keys} | {"e2e_latency"}


def test_which_models_are_served_as_reward_models(reward_model, tiny_model, tmp_path):
    assert reward_model_kind(reward_model, is_embedding=False) is True
    assert reward_model_kind(tiny_model, is_embedding=False) is False
    with pytest.raises(ValueError, match="--is-embedding with architectures"):
        reward_model_kind(tiny_model, is_embedding=True)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2ForSequenceClassification"]}))
    with pytest.raises(ValueError, match=r"SGLang 0\.5\.23 serves only"):
        reward_model_kind(tmp_path, is_embedding=False)


def test_generation_flags_with_a_reward_model_are_refused_not_ignored():
    from hpcrl.errors import UserError
    from hpcrl.inference.server.__main__ import parse_args, refuse_generation_flags

    refuse_generation_flags(parse_args(["--model-path", "/m", "--port", "1", "--is-embedding"]))
    args = parse_args(["--model-path", "/m", "--port", "1", "--tp-size", "2", "--allow-auto-truncate"])
    with pytest.raises(UserError, match="--tp-size, --allow-auto-truncate with a reward model"):
        refuse_generation_flags(args)
