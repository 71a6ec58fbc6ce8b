"""PortSlots and worker_ports: every listener of a run gets a slice of the port range of its own."""

import pytest

from hpcrl.launch.slots import PortSlots, worker_ports

RANGE = (20000, 20700)


def test_slots_number_the_controller_then_each_role_in_order():
    slots = PortSlots({"server": 2, "trainer": 4})
    assert (slots.controller, slots.world) == (0, 7)
    assert (slots.base("server"), slots.base("trainer")) == (1, 3)
    assert [slots.slot("trainer", r) for r in range(4)] == [3, 4, 5, 6]
    assert slots.env("trainer") == {"HPCRL_PORT_SLOT_BASE": "3", "HPCRL_PORT_WORLD": "7"}


def test_every_slot_gets_a_disjoint_slice():
    slots = PortSlots({"server": 2, "trainer": 4})
    slices = [slots.allocator(s, RANGE).slice for s in range(slots.world)]
    assert slices == [(20000 + 100 * s, 20100 + 100 * s) for s in range(7)]


def test_worker_ports_draw_from_base_plus_rank():
    slots = PortSlots({"server": 2, "trainer": 4})
    env = {**slots.env("trainer"), "HPCRL_RANK": "2"}
    assert worker_ports(RANGE, env).slice == slots.allocator(slots.slot("trainer", 2), RANGE).slice
    port = worker_ports(RANGE, env).allocate(1)[0]
    assert 20500 <= port < 20600


def test_worker_ports_fall_back_to_torchrun_rank():
    env = {"HPCRL_PORT_SLOT_BASE": "1", "HPCRL_PORT_WORLD": "7", "RANK": "1"}
    assert worker_ports(RANGE, env).slice == (20200, 20300)
    assert worker_ports(RANGE, {**env, "HPCRL_RANK": "0"}).slice == (20100, 20200)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"HPCRL_PORT_WORLD": "3", "HPCRL_RANK": "0"}, "HPCRL_PORT_SLOT_BASE is not set"),
        ({"HPCRL_PORT_SLOT_BASE": "1", "HPCRL_PORT_WORLD": "3"}, "RANK is not set"),
        ({"HPCRL_PORT_SLOT_BASE": "x", "HPCRL_PORT_WORLD": "3", "HPCRL_RANK": "0"}, "is not an integer"),
        ({"HPCRL_PORT_SLOT_BASE": "2", "HPCRL_PORT_WORLD": "3", "HPCRL_RANK": "1"}, r"slot 3 .* outside 0..2"),
        ({"HPCRL_PORT_SLOT_BASE": "2", "HPCRL_PORT_WORLD": "3", "HPCRL_RANK": "-1"}, "outside"),
    ],
)
def test_worker_ports_refuse_a_missing_or_impossible_slot(env, message):
    with pytest.raises((RuntimeError, ValueError), match=message):
        worker_ports(RANGE, env)


def test_bad_roles_and_ranks_are_refused():
    slots = PortSlots({"server": 2})
    with pytest.raises(ValueError, match="no port slots for role 'trainer': PortSlots was made for server"):
        slots.base("trainer")
    with pytest.raises(ValueError, match="server rank 2 has no port slot: server has 2 workers"):
        slots.slot("server", 2)
    with pytest.raises(ValueError, match="count of workers >= 1, got 0"):
        PortSlots({"server": 0})
    assert PortSlots({}).world == 1  # the controller alone


def test_a_torchrun_role_s_rendezvous_has_a_slot_after_every_worker_s():
    slots = PortSlots({"server": 2, "trainer": 4}, rendezvous=("trainer",))
    assert (slots.base("trainer"), slots.rendezvous("trainer"), slots.world) == (3, 7, 8)
    low, high = slots.allocator(slots.rendezvous("trainer"), (20000, 20800)).slice
    assert (low, high) == (20700, 20800)
    with pytest.raises(ValueError, match=r"no rendezvous slot for role 'server'.*rendezvous=\('server',\)"):
        slots.rendezvous("server")
    with pytest.raises(ValueError, match="no port slots for role 'critic'"):
        PortSlots({"trainer": 1}, rendezvous=("critic",))
