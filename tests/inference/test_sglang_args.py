"""``inference.extra_args`` are read as SGLang 0.5.23 reads them: checked against SGLang's own launch parser, built
from its wheel (``sglang_launch_parser.py``), and the context a server of those arguments leaves a request."""

import json

import pytest

from hpcrl.config import ConfigError
from hpcrl.config.schema import LORA_TARGETS
from hpcrl.inference.sglang import MAX_LORAS_PER_BATCH, sglang_command
from hpcrl.inference.sglang_args import (
    _READ,
    LORA_MANAGED,
    MANAGED,
    _dest,
    _parser,
    human_readable_int,
    launch_args,
    served_context,
)
from hpcrl.inference.sglang_flags import ACTIONS, LORA_TARGET_MODULES
from tests.inference import sglang_launch_parser as sglang
from tests.inference.sglang_wheel import Wheel, fetch_wheel

EAGLE = ["--speculative-num-steps", "3", "--speculative-eagle-topk", "4", "--speculative-num-draft-tokens", "8"]


@pytest.fixture(scope="module")
def wheel() -> Wheel:
    return Wheel(fetch_wheel())


@pytest.fixture(scope="module")
def sglang_parser(wheel):
    return sglang.launch_parser(wheel)


def test_hpcrl_knows_every_option_of_sglangs_launch_parser(sglang_parser):
    """The options an abbreviation is matched against, grouped by action as SGLang registers them."""
    theirs, ours = sglang.actions(sglang_parser), set(ACTIONS)
    assert len(theirs) > 500  # the parser was built, not an empty one
    missing = "\n".join(" ".join(strings) for strings in sorted(theirs - ours))
    stale = "\n".join(" ".join(strings) for strings in sorted(ours - theirs))
    assert theirs == ours, f"hpcrl/inference/sglang_flags.py lacks:\n{missing}\nand has, which SGLang has not:\n{stale}"


def test_the_options_hpcrl_reads_take_their_values_as_in_sglang(sglang_parser):
    """How many values each option read here takes, and its type, are SGLang's (a store_true is a flag here too)."""
    theirs = {a.option_strings[0]: a for a in sglang_parser._actions if a.option_strings}
    for flag, how in _READ.items():
        action = theirs[flag]
        takes_none = "const" in how
        assert (action.nargs == 0) == takes_none, flag
        if not takes_none and flag not in MANAGED and flag not in LORA_MANAGED:
            assert getattr(action.type, "__name__", action.type) == how.get("type", str).__name__, flag


def test_hpcrls_lora_options_read_as_sglang_reads_them(sglang_parser):
    """What SGLang makes of a LoRA server's command: LoRA on, its rank, the modules and the batch's adapters."""
    lora_targets = sglang_parser._option_string_actions["--lora-target-modules"].choices
    assert list(LORA_TARGET_MODULES) == lora_targets, "hpcrl/inference/sglang_flags.py's LORA_TARGET_MODULES"
    cmd = sglang_command("/m", "::", 1, lora_rank=16, lora_target_modules=LORA_TARGETS, extra_args=["--max-total-t=9"])
    theirs = sglang_parser.parse_args(cmd[3:])
    assert (theirs.enable_lora, theirs.max_lora_rank, theirs.max_loras_per_batch) == (True, 16, MAX_LORAS_PER_BATCH)
    assert theirs.lora_target_modules == LORA_TARGETS and theirs.max_total_tokens == 9
    with pytest.raises(sglang.ParseError, match="invalid choice: 'c_attn'"):  # what hpcrl refuses before launch
        sglang_parser.parse_args(["--model-path", "/m", "--lora-target-modules", "c_attn"])


@pytest.mark.parametrize(
    "argv",
    [
        ["--context-len", "32k"],  # an abbreviation: SGLang sets --context-length
        ["--context-length=4Ki", "--enable-metrics", "--context-length", "25.6k"],  # the last one wins
        ["--pipeline-parallel-size", "2", "--pp-size=3"],
        ["--data-parallel-size=2", "--enable-dp-attention"],
        ["--attention-data-parallel-size", "4", "--dp-size", "1"],
        ["--speculative-algo", "eagle3", *EAGLE, "--speculative-adaptive"],
        ["--json-model-override-args", '{"max_position_embeddings": 300}', "--tensor-parallel-size", "2"],
        ["--speculative-draft-model-path", "/d", "--speculative-num-steps", "5", "--conf", "x.yaml"],
    ],
)
def test_extra_args_parse_as_in_sglang(sglang_parser, argv):
    theirs = sglang_parser.parse_args(["--model-path", "/m", *argv])
    ours, _ = _parser().parse_known_args(argv)
    for flag in set(_READ) - {"-h"} - set(MANAGED):  # those are refused whatever their value
        dest = _dest(flag)
        sglang_dest = next(a.dest for a in sglang_parser._actions if flag in a.option_strings)
        value = getattr(ours, dest)
        expected = getattr(theirs, sglang_dest)
        assert (value if value is not None else sglang_parser.get_default(sglang_dest)) == expected, flag


@pytest.mark.parametrize(
    "argv",
    [
        ["--d", "2"],  # ambiguous: --dp-size, --dtype, --device, ...
        ["--pp", "2"],  # ambiguous: --pp-size, --pp-max-micro-batch-size, ...
        ["--context-length", "abc"],
        ["--context-length", "1.5Ki"],  # no decimals with an IEC suffix
        ["--enable-dp-attention=1"],  # a flag takes no value
        ["--pp-size", "two"],
        ["--speculative-num-steps"],  # a value missing
    ],
)
def test_what_sglangs_parser_refuses_is_refused(sglang_parser, argv):
    with pytest.raises(sglang.ParseError):
        sglang_parser.parse_args(["--model-path", "/m", *argv])
    with pytest.raises(ConfigError, match="SGLang's launch parser accepts") as err:
        launch_args(argv)
    assert err.value.path == "inference.extra_args"


SIZES = ["4096", " 2048 ", "32k", "25.6k", "0.0001k", "1M", "0.5G", "2T", "4Ki", "1Mi", "3Gi", "1Ti", "1_000", "-1"]
NOT_SIZES = ["1.5Ki", "32K", "k", "", "4 k", "1e3", "abc", "12kk", "0x10", ".5k"]


@pytest.mark.parametrize("text", SIZES + NOT_SIZES)
def test_context_sizes_read_as_sglang_reads_them(wheel, text):
    theirs = sglang.human_readable_int(wheel)
    try:
        expected = theirs(text)
    except Exception as e:
        with pytest.raises(type(e)):
            human_readable_int(text)
    else:
        assert human_readable_int(text) == expected


def write_config(path, **config) -> str:
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def test_the_context_is_sglangs_for_the_extra_args(tmp_path):
    """``--context-len`` is read (it was not), as are the overrides of config.json and EAGLE's draft slots."""
    model = write_config(tmp_path, max_position_embeddings=4096, rope_scaling={"type": "linear", "factor": 2.0})
    assert served_context(model, []) == 8192
    assert served_context(model, ["--context-len", "3k"]) == 3000
    assert served_context(model, ["--context-length=2Ki", "--context-length", "1000"]) == 1000
    override = json.dumps({"max_position_embeddings": 1024, "rope_scaling": {"factor": 4.0}})
    assert served_context(model, ["--json-model-override-args", override]) == 4096  # merged: still linear, x4
    assert served_context(model, ["--speculative-algorithm", "nextn", *EAGLE]) == 8192 - max(4 * 3, 8)
    assert served_context(model, ["--speculative-algorithm", "EAGLE", *EAGLE[:4], "--speculative-num-d", "20"]) == (
        8192 - 20
    )
    assert served_context(model, ["--speculative-algorithm", "NGRAM"]) == 8192  # holds no output slots
    vlm = write_config(tmp_path, max_position_embeddings=99, text_config={"max_position_embeddings": 2048})
    assert served_context(vlm, ["--json-model-override-args", '{"text_config": {"seq_length": 700}}']) == 700
