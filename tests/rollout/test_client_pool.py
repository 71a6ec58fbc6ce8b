"""Taking a dead server out of the client's pool."""

import pytest

from hpcrl.rollout.client import InferenceClient


def test_a_removed_server_is_never_picked_and_gets_no_control_call():
    client = InferenceClient(["h:1", "h:2", "h:3"])
    client.remove("h:2")
    assert {client.pick() for _ in range(10)} == {"h:1", "h:3"}
    assert set(client._same({})) == {"h:1", "h:3"}  # pause, resume, weight updates go to these only


def test_the_last_server_and_unknown_ones_cannot_be_removed():
    client = InferenceClient(["h:1", "h:2"])
    with pytest.raises(ValueError, match="not in the pool"):
        client.remove("h:9")
    client.remove("h:1")
    with pytest.raises(ValueError, match="the last one"):
        client.remove("h:2")
