"""What crosses the wire to and from a rollout worker for the reward: the row's columns out, the reward's parts back."""

from hpcrl.rollout.remote import EpisodeRequest
from hpcrl.rollout.workflows.base import Group, Sample
from hpcrl.rpc.wire import decode, encode


def test_an_episode_request_carries_the_rows_columns_and_a_group_its_reward_parts():
    row = {"prompt": "1+2=", "answer": "3", "columns": {"low": 1, "tags": ["a", None], "meta": {"k": 2.5}}, "draw": 7}
    request = decode(encode(EpisodeRequest.of(row, seed=5)), EpisodeRequest)
    assert (request.prompt, request.answer, request.seed) == ("1+2=", "3", 5)
    assert request.columns == {"low": "1", "tags": '["a", null]', "meta": '{"k": 2.5}'}, "each column as JSON text"
    assert request.row_columns() == row["columns"]
    assert decode(encode(EpisodeRequest.of({"prompt": "p", "answer": "a"}, None)), EpisodeRequest).row_columns() == {}
    sample = Sample([1], [0.0], [0], "stop", "3", 2.5, None, reward_parts={"exact": 1.0, "short": 0.75})
    (back,) = decode(encode(Group("1+2=", "3", [4], [sample]))).samples
    assert back.reward_parts == {"exact": 1.0, "short": 0.75} and back.reward == 2.5
