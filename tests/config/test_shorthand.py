import pytest

from hpcrl.config import ConfigError, format_spec, parse_spec
from hpcrl.config.schema import ClusterConfig
from tests.config.compose import load


def test_parse_two_roles():
    roles = parse_spec("sglang:d4t2+fsdp:d8")
    assert (roles["server"].backend, roles["server"].workers, roles["server"].tp_size) == ("sglang", 4, 2)
    assert (roles["trainer"].backend, roles["trainer"].workers) == ("fsdp", 8)
    assert roles["trainer"].gpus_per_worker is None and roles["trainer"].nodes == 0


def test_parse_every_field_and_any_order():
    roles = parse_spec("fsdp:n2d16g1+sglang:t4d8n4")
    s, t = roles["server"], roles["trainer"]
    assert (s.workers, s.tp_size, s.nodes) == (8, 4, 4)
    assert (t.workers, t.gpus_per_worker, t.nodes) == (16, 1, 2)


def test_parse_a_critic_role():
    roles = parse_spec("sglang:d4t2+fsdp:d8+critic:d2n1")
    assert (roles["critic"].backend, roles["critic"].workers, roles["critic"].nodes) == ("fsdp", 2, 1)
    assert "critic" not in parse_spec("sglang:d4t2+fsdp:d8"), "no critic unless named"


@pytest.mark.parametrize(
    "spec",
    ["cpu:d1+fsdp:d2g0", "sglang:d4t2+fsdp:d8", "sglang:d8t2n2+fsdp:d16g1n2", "sglang:d4t2+fsdp:d8+critic:d4g1"],
)
def test_format_round_trips(spec):
    assert parse_spec(format_spec(parse_spec(spec))) == parse_spec(spec)


def test_shorthand_equals_the_named_allocation():
    named = load("cluster=slurm", "allocation=2node_16gpu").allocation
    short = load("cluster=slurm", "allocation.spec=sglang:d4t2+fsdp:d8").allocation
    assert named.roles() == short.roles()


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("sglang:d4t2", "a trainer role"),
        ("fsdp:d8", "a server role"),
        ("vllm:d4+fsdp:d8", "a backend among cpu, sglang, fsdp"),
        ("sglang+fsdp:d8", "a backend among"),
        ("sglang:+fsdp:d8", "fields like d4t2"),
        ("sglang:d4x2+fsdp:d8", "each of d, t, g, n at most once"),
        ("sglang:d4d2+fsdp:d8", "each of d, t, g, n at most once"),
        ("sglang:t2+fsdp:d8", "a worker count d<N>"),
        ("sglang:d4-2+fsdp:d8", "fields like d4t2"),
        ("sglang:d4+cpu:d1+fsdp:d8", "a second server"),
        ("", "a backend among"),
    ],
)
def test_malformed_shorthand_names_field_value_and_form(spec, expected):
    with pytest.raises(ConfigError) as err:
        parse_spec(spec)
    message = str(err.value)
    assert message.startswith(f"allocation.spec={spec!r} is invalid")
    assert expected in message and "the form is BACKEND:FIELDS" in message


def test_the_critic_resolves_where_the_trainer_is_and_only_with_workers():
    ppo = load("algorithm=ppo").allocation  # the default job's trainers are on CPUs: so is its critic
    assert (ppo.critic.workers, ppo.critic.gpus_per_worker, ppo.critic.nodes) == (1, 0, 1)
    assert "critic" in ppo.roles() and format_spec(ppo.roles()).endswith("+critic:d1g0n1")
    gpus = load("cluster=slurm", "algorithm=ppo", "allocation.spec=sglang:d4t2+fsdp:d8n1+critic:d8").allocation
    assert (gpus.critic.gpus_per_worker, gpus.critic.nodes) == (1, 1)
    grpo = load().allocation
    assert grpo.critic.workers == 0 and "critic" not in grpo.roles()


def test_zero_counts_in_shorthand_are_rejected_when_resolved():
    from hpcrl.config.allocation import resolve_allocation
    from hpcrl.config.schema import AllocationConfig

    with pytest.raises(ConfigError, match=r"allocation.trainer.workers=0 is invalid: expected an integer >= 1"):
        resolve_allocation(AllocationConfig(spec="cpu:d1+fsdp:d0g0"), ClusterConfig())


def test_rm_names_the_reward_models_servers_and_round_trips():
    roles = parse_spec("cpu:d1+fsdp:d1+rm:sglang:d2t2n1")
    rm = roles["reward_model"]
    assert (rm.backend, rm.workers, rm.tp_size, rm.nodes) == ("sglang", 2, 2, 1)
    assert format_spec(roles) == "cpu:d1+fsdp:d1+rm:sglang:d2t2n1"
    assert "reward_model" not in parse_spec("cpu:d1+fsdp:d1"), "no reward model unless named"


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("cpu:d1+fsdp:d1+rm:fsdp:d1", "rm: then a server backend among cpu, sglang then ':' in 'rm:fsdp:d1'"),
        ("cpu:d1+fsdp:d1+rm:d1", "rm: then a server backend among cpu, sglang then ':' in 'rm:d1'"),
        ("cpu:d1+fsdp:d1+rm:cpu:d1+rm:cpu:d2", "a second reward_model (one backend per role) in 'rm:cpu:d2'"),
    ],
)
def test_a_malformed_rm_part_is_named(spec, expected):
    with pytest.raises(ConfigError, match=r"^allocation\.spec=") as e:
        parse_spec(spec)
    assert expected in str(e.value)


def test_the_reward_model_resolves_like_a_server_and_needs_its_directory(tmp_path):
    cfg = load("allocation.spec=cpu:d1+fsdp:d1g0+rm:cpu:d2", f"reward.model.path={tmp_path}")
    assert (cfg.allocation.reward_model.workers, cfg.allocation.reward_model.gpus_per_worker) == (2, 0)
    assert "reward_model" in cfg.allocation.roles()
    cases = [
        (("allocation.reward_model.workers=1",), "reward.model.path='' is invalid: expected the reward model's"),
        ((f"reward.model.path={tmp_path}",), "reward.model.path="),  # a path with no servers
        (("allocation.reward_model.workers=1", f"reward.model.path={tmp_path}/none"), "an existing directory"),
        (("allocation.reward_model.workers=1", f"reward.model.path={tmp_path}", "reward.model.kind=score"), "kind"),
        (("allocation.reward_model.workers=1", "allocation.reward_model.backend=fsdp"), "reward_model.backend"),
        (
            ("allocation.spec=cpu:d1+fsdp:d1g0+rm:sglang:d1t2g1",),  # one GPU per tensor-parallel rank, as a server's
            "allocation.reward_model.gpus_per_worker=1 is invalid: expected tp_size=2",
        ),
        (("allocation.reward_model.workers=1", "allocation.reward_model.min_workers=1"), "reward_model.min_workers"),
    ]
    for overrides, expected in cases:
        with pytest.raises(ConfigError) as e:
            load(*overrides)
        assert expected in str(e.value) and "\n" not in str(e.value), (overrides, str(e.value))
