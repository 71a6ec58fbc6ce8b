"""Fuzzing ``decode``: whatever the bytes, the only exception that escapes is DecodeError.

Four sources of input, 12,000 examples in all (3,000 + 2,500 + 3,500 + 3,000): random bytes; random
bytes behind a valid prelude; valid frames with bytes flipped, inserted, deleted or cut; and valid
frames whose JSON header was edited (values replaced, keys dropped or added, numbers nudged) and then
re-framed with correct lengths, so the input gets past the framing checks into the header,
tensor-table and field checks.
"""

from __future__ import annotations

import json
import struct

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hpcrl.rpc import MESSAGES, DecodeError, decode, encode
from hpcrl.rpc.messages import Echo, SequenceBatch, SequenceData, TrainStep
from hpcrl.rpc.wire import ALIGN, MAGIC
from tests.rpc.conftest import assert_same, sample

PRELUDE = struct.Struct(">4sHIQ")
_BASE = settings(deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def fuzz(examples: int) -> settings:
    return settings(_BASE, max_examples=examples)


TENSORS = [
    torch.arange(5, dtype=torch.int64),
    torch.tensor([True, False, True]),
    torch.randn(2, 3).bfloat16(),
    torch.empty(0, 2, dtype=torch.float16),
    torch.tensor(2.5),
]
FRAMES = [encode(sample(cls, seed)) for cls in MESSAGES.values() for seed in (0, 2)]
FRAMES += [encode(Echo(TENSORS, "many dtypes")), encode(Echo([], ""))]
_SEQ = SequenceData([1, 2], [0, 1], 1.0, [0.5, 0.25], None, None, [3, 3])
FRAMES += [encode(TrainStep(SequenceBatch.pack([_SEQ] * 3), 1.0))]


def decodes_or_says_why(data: bytes) -> None:
    """Both the copying (bytes) and the zero-copy (bytearray) paths raise nothing but DecodeError."""
    for buffer in (data, bytearray(data)):
        try:
            decode(buffer)
        except DecodeError as e:
            assert str(e), "a DecodeError must say what was wrong"


@fuzz(3000)
@given(st.binary(max_size=600))
def test_random_bytes(data):
    decodes_or_says_why(data)


@fuzz(2500)
@given(st.integers(0, 2**32 - 1), st.integers(0, 2**64 - 1), st.binary(max_size=600))
def test_random_bytes_behind_a_valid_prelude(header_len, data_len, rest):
    decodes_or_says_why(PRELUDE.pack(MAGIC, 1, header_len, data_len) + rest)
    header_len = 46 + ALIGN * max(0, (len(rest) - 46) // ALIGN)  # ends on the boundary: the JSON is parsed
    decodes_or_says_why(PRELUDE.pack(MAGIC, 1, header_len, max(0, len(rest) - header_len)) + rest)


EDITS = st.tuples(
    st.sampled_from(["flip", "set", "insert", "delete", "cut"]),
    st.integers(0, 2**20),
    st.binary(min_size=1, max_size=8),
)


@fuzz(3500)
@given(st.sampled_from(FRAMES), st.lists(EDITS, min_size=1, max_size=4))
def test_mutated_frames(frame, edits):
    data = bytearray(frame)
    for kind, pos, blob in edits:
        pos %= len(data) + 1
        if kind == "flip" and pos < len(data):
            data[pos] ^= blob[0] or 1
        elif kind == "set":
            data[pos : pos + len(blob)] = blob
        elif kind == "insert":
            data[pos:pos] = blob
        elif kind == "delete":
            del data[pos : pos + len(blob)]
        else:
            del data[pos:]
    decodes_or_says_why(bytes(data))


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=6,
)
TYPE_NAMES = st.sampled_from([*MESSAGES, "", "object", "__class__", "Echo "])


def _paths(node, prefix=()):
    """Every location in a JSON tree, as a tuple of keys and indices."""
    yield prefix
    children = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else []
    for key, child in children:
        yield from _paths(child, (*prefix, key))


def _apply(header, path, op, value):
    if not path:
        return value if op == "replace" else header
    *parents, key = path
    parent = header
    for p in parents:
        parent = parent[p]
    old = parent[key]
    if op == "replace":
        parent[key] = value
    elif op == "drop":
        del parent[key]
    elif op == "nudge" and type(old) is int:
        parent[key] = old + (value if type(value) is int and abs(value) < 100 else 1)
    elif op == "add" and isinstance(old, dict):
        old[str(value)[:8]] = value
    elif op == "add" and isinstance(old, list):
        old.append(value)
    return header


@fuzz(3000)
@given(st.sampled_from(FRAMES), st.data())
def test_edited_json_headers(frame, data):
    _, _, header_len, _ = PRELUDE.unpack(frame[: PRELUDE.size])
    header = json.loads(frame[PRELUDE.size : PRELUDE.size + header_len])
    region = frame[PRELUDE.size + header_len :]
    for _ in range(data.draw(st.integers(1, 3))):
        path = data.draw(st.sampled_from(list(_paths(header))))
        op = data.draw(st.sampled_from(["replace", "drop", "nudge", "add", "type"]))
        value = data.draw(TYPE_NAMES if op == "type" else JSON)
        header = _apply(header, path, "replace" if op == "type" else op, value)
    if data.draw(st.booleans()):
        region = region[: data.draw(st.integers(0, len(region)))]
    raw = json.dumps(header).encode()
    raw += b" " * (-(PRELUDE.size + len(raw)) % ALIGN)
    decodes_or_says_why(PRELUDE.pack(MAGIC, 1, len(raw), len(region)) + raw + region)


@fuzz(300)
@given(
    st.lists(st.tuples(st.integers(-(2**31), 2**31 - 1), st.floats(allow_nan=False, width=32)), max_size=50),
    st.floats(allow_nan=False),
    st.booleans(),
    st.sampled_from([torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.uint8]),
    st.lists(st.integers(0, 4), max_size=3),
    st.text(),
)
def test_valid_messages_round_trip(tokens, advantage, has_logprobs, dtype, shape, note):
    ids, logprobs = [i for i, _ in tokens], [lp for _, lp in tokens] if has_logprobs else None
    seq = SequenceData(ids, [1] * len(ids), advantage, logprobs, None, logprobs, None)
    t = (torch.arange(max(1, torch.Size(shape).numel())) % 3).to(dtype)[: torch.Size(shape).numel()].reshape(shape)
    for msg in (TrainStep(SequenceBatch.pack([seq]), advantage), Echo([t, t.flatten()], note)):
        assert_same(decode(encode(msg)), msg)
    assert decode(encode(TrainStep(SequenceBatch.pack([seq]), 1.0))).batch.unpack() == [seq]
