"""The frame format: round trips, exact tensors, and a clear DecodeError for each kind of bad frame."""

from __future__ import annotations

import dataclasses
import json
import struct

import pytest
import torch

from hpcrl.rpc import MESSAGES, DecodeError, EncodeError, decode, encode, encode_parts, register
from hpcrl.rpc.messages import Ack, Echo, Ping, Pong, SequenceBatch, SequenceData, TrainStep
from hpcrl.rpc.wire import ALIGN, MAGIC
from tests.rpc.conftest import assert_same, sample

PRELUDE = struct.Struct(">4sHIQ")


def split(frame: bytes) -> tuple[dict, bytes]:
    """The JSON header and the data region of a frame."""
    _, _, header_len, _ = PRELUDE.unpack(frame[: PRELUDE.size])
    return json.loads(frame[PRELUDE.size : PRELUDE.size + header_len]), frame[PRELUDE.size + header_len :]


def join(header: dict, data: bytes, version: int = 1) -> bytes:
    """A frame around an edited header, with lengths and padding right so decoding reaches the header."""
    raw = json.dumps(header).encode()
    raw += b" " * (-(PRELUDE.size + len(raw)) % ALIGN)
    return PRELUDE.pack(MAGIC, version, len(raw), len(data)) + raw + data


@pytest.mark.parametrize("name", sorted(MESSAGES))
@pytest.mark.parametrize("seed", [0, 2])
def test_every_message_type_round_trips(name, seed):
    msg = sample(MESSAGES[name], seed)
    assert_same(decode(encode(msg)), msg)
    assert_same(decode(bytearray(encode(msg)), expected=MESSAGES[name]), msg)


DTYPE_CASES = {
    "bfloat16": torch.tensor([1.5, -0.0, float("inf"), float("nan"), 3.1e38, 1e-40]).bfloat16(),
    "float16": torch.tensor([65504.0, -0.0, float("nan"), 6e-8]).half(),
    "float32": torch.randn(3, 4),
    "float64": torch.randn(2, 2, 2, dtype=torch.float64),
    "int64": torch.tensor([-(2**63), 2**63 - 1, 0, -1]),
    "int32": torch.tensor([-(2**31), 2**31 - 1], dtype=torch.int32),
    "uint8": torch.arange(256, dtype=torch.uint8),
    "int8": torch.tensor([-128, 127], dtype=torch.int8),
    "bool": torch.tensor([[True, False], [False, True]]),
    "complex64": torch.tensor([1 + 2j, -3j], dtype=torch.complex64),
    "float8_e4m3fn": torch.tensor([1.0, -2.0, 448.0]).to(torch.float8_e4m3fn),
}


@pytest.mark.parametrize("dtype", sorted(DTYPE_CASES))
@pytest.mark.parametrize("writable", [False, True])
def test_tensors_are_bit_exact_with_their_dtype(dtype, writable):
    t = DTYPE_CASES[dtype]
    frame = encode(Echo([t, t[:1]], dtype))
    out = decode(bytearray(frame) if writable else frame)
    assert [x.dtype for x in out.tensors] == [t.dtype, t.dtype]
    assert_same(out, Echo([t, t[:1]], dtype))


def test_bf16_nan_payload_bits_survive():
    # two NaN payloads, +inf and the smallest denormal
    bits = torch.tensor([0x7FC1, 0xFF81 - 0x10000, 0x7F80, 0x0001], dtype=torch.int16)
    out = decode(encode(Echo([bits.view(torch.bfloat16)], "")))
    assert out.tensors[0].dtype is torch.bfloat16
    assert out.tensors[0].view(torch.int16).tolist() == bits.tolist()


@pytest.mark.parametrize(
    "t",
    [
        torch.arange(24.0).reshape(4, 6).t(),  # non-contiguous
        torch.arange(24.0).reshape(2, 3, 4)[:, 1],  # strided slice
        torch.tensor(3.25, dtype=torch.float64),  # 0-d
        torch.empty(0, 5, dtype=torch.bfloat16),  # empty
        torch.ones(3, requires_grad=True),  # autograd leaf
        torch.tensor([1 + 1j]).conj(),  # conjugate bit
    ],
    ids=["transposed", "slice", "scalar", "empty", "requires_grad", "conj"],
)
def test_tensor_layouts(t):
    out = decode(encode(Echo([t], "")))
    assert_same(out.tensors[0], t.detach().resolve_conj())


def test_tensors_are_aligned_and_share_a_writable_buffer():
    frame = bytearray(encode(Echo([torch.ones(3, dtype=torch.int8), torch.arange(5, dtype=torch.float64)], "")))
    out = decode(frame)
    ptrs = [t.data_ptr() for t in out.tensors]
    assert (ptrs[1] - ptrs[0]) % ALIGN == 0
    out.tensors[1][0] = 42.0  # shares the buffer: no copy on decode
    assert decode(frame).tensors[1][0].item() == 42.0
    del frame
    assert out.tensors[1].tolist() == [42.0, 1.0, 2.0, 3.0, 4.0]  # the tensor keeps the buffer alive


def test_encode_parts_does_not_copy_tensor_bytes():
    t = torch.arange(1000, dtype=torch.float32)
    parts = encode_parts(Echo([t], ""))
    assert any(
        isinstance(p, memoryview) and torch.frombuffer(p, dtype=torch.uint8).data_ptr() == t.data_ptr() for p in parts
    )
    assert b"".join(parts) == encode(Echo([t], ""))


def test_float_field_accepts_int_and_keeps_float():
    out = decode(encode(TrainStep(SequenceBatch.pack([]), temperature=1)))
    assert out.temperature == 1.0 and type(out.temperature) is float


@pytest.mark.parametrize(
    "msg, fragment",
    [
        (Pong(rank="0", pid=1), "Pong.rank: expected int, got str"),
        (Pong(rank=True, pid=1), "Pong.rank: expected int, got bool"),
        (TrainStep(SequenceBatch.pack([]), "x"), "TrainStep.temperature: expected float"),
        (Echo([torch.zeros(2), "not a tensor"], ""), "Echo.tensors[1]: expected torch.Tensor"),
        (TrainStep(batch=None, temperature=1.0), "TrainStep.batch: expected SequenceBatch"),
    ],
)
def test_encode_refuses_wrong_field_types(msg, fragment):
    with pytest.raises(EncodeError, match=fragment.replace("[", r"\[").replace("]", r"\]")):
        encode(msg)


def test_encode_refuses_unregistered_messages():
    @dataclasses.dataclass
    class Ping:  # same name, different class
        pass

    with pytest.raises(EncodeError, match="not a registered message"):
        encode(Ping())


def test_register_checks_annotations_and_names():
    @dataclasses.dataclass
    class BadTuple:
        x: tuple[int, int]

    with pytest.raises(TypeError, match=r"BadTuple.x: annotation .* is not supported"):
        register(BadTuple)

    @dataclasses.dataclass
    class Ack:
        pass

    with pytest.raises(ValueError, match="already registered"):
        register(Ack)
    assert "BadTuple" not in MESSAGES


def _valid() -> bytes:
    return encode(Echo([torch.arange(4, dtype=torch.int32), torch.tensor([True, False])], "n"))


def _edit(edit) -> bytes:
    header, data = split(_valid())
    edit(header)
    return join(header, data)


BAD_FRAMES = {
    "empty": (b"", "shorter than the 18-byte prelude"),
    "magic": (b"GET / HTTP/1.1\r\n" + bytes(100), "not an hpcrl RPC frame"),
    "version": (join(*split(_valid()), version=9), "version 9 is not supported"),
    "truncated": (_valid()[:-3], "frame truncated"),
    "trailing": (_valid() + b"\0", "1 trailing bytes"),
    "unaligned header": (PRELUDE.pack(MAGIC, 1, 3, 0) + b"{} ", "64-byte boundary"),
    "not json": (PRELUDE.pack(MAGIC, 1, 46, 0) + b"{" * 46, "not valid JSON"),
    "not utf8": (PRELUDE.pack(MAGIC, 1, 46, 0) + b"\xff" * 46, "not UTF-8"),
    "header keys": (_edit(lambda h: h.pop("tensors")), "keys ['type', 'body', 'tensors']"),
    "unknown type": (_edit(lambda h: h.update(type="Pickle")), "unknown message type 'Pickle'"),
    "expected": (_valid(), "expected a Ping message, got Echo"),
    "missing field": (_edit(lambda h: h["body"].pop("note")), "missing ['note']"),
    "extra field": (_edit(lambda h: h["body"].update(evil=1)), "unexpected ['evil']"),
    "field type": (_edit(lambda h: h["body"].update(note=3)), "Echo.note: expected str, got an int"),
    "bad ref": (_edit(lambda h: h["body"]["tensors"].__setitem__(0, 0)), "expected a tensor reference"),
    "ref range": (_edit(lambda h: h["body"]["tensors"][0].update({"$tensor": 5})), "outside the table"),
    "ref twice": (_edit(lambda h: h["body"]["tensors"][1].update({"$tensor": 0})), "referenced twice"),
    "unreferenced": (_edit(lambda h: h["body"]["tensors"].pop()), "body references 1"),
    "dtype": (_edit(lambda h: h["tensors"][0].update(dtype="object")), "unknown dtype 'object'"),
    "shape": (_edit(lambda h: h["tensors"][0].update(shape=[-4])), "shape must be a list of non-negative"),
    "shape*itemsize": (_edit(lambda h: h["tensors"][0].update(shape=[5])), "nbytes 16 != prod(shape [5])"),
    "offset": (_edit(lambda h: h["tensors"][1].update(offset=16)), "offset 16 should be 64"),
    "past end": (_edit(lambda h: h["tensors"][1].update(shape=[70], nbytes=70)), "run past"),
    "data tail": (_edit(lambda h: h["tensors"].pop() and h["body"]["tensors"].pop()), "tensors end at 16"),
    "bool bytes": (_valid()[:-2] + b"\x07" + _valid()[-1:], "bool tensor holds bytes"),
    "huge float": (
        join({"type": "HostWeightGroup", "body": {"timeout_s": 10**400}, "tensors": []}, b""),
        "too large",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_FRAMES))
def test_bad_frames_raise_decode_error_saying_what(case):
    frame, fragment = BAD_FRAMES[case]
    with pytest.raises(DecodeError) as info:
        decode(frame, expected=Ping if case == "expected" else None)
    assert fragment in str(info.value)


def test_decode_error_is_a_value_error_and_not_for_other_inputs():
    assert issubclass(DecodeError, ValueError)
    with pytest.raises(DecodeError, match="expected bytes"):
        decode("a string")  # type: ignore[arg-type]


def test_json_nesting_bomb_is_a_decode_error():
    with pytest.raises(DecodeError):
        decode(_edit(lambda h: h["body"].update(note=[[[[]]]])))
    deep = json.dumps({"type": "Ack", "body": {}, "tensors": []}).replace("{}", "[" * 100_000 + "]" * 100_000)
    raw = deep.encode() + b" " * (-(PRELUDE.size + len(deep)) % ALIGN)
    with pytest.raises(DecodeError):
        decode(PRELUDE.pack(MAGIC, 1, len(raw), 0) + raw)


def test_nested_messages_and_optional_fields():
    seq = SequenceData([1, 2, 3], [0, 1, 1], -0.5, [0.1, 0.2, 0.3], None, [float("-inf")] * 3, None)
    out = decode(encode(TrainStep(SequenceBatch.pack([seq, seq]), 0.7)))
    assert out.batch.prox_logprobs is None and out.batch.unpack()[1].ref_logprobs[0] == float("-inf")
    assert_same(out, TrainStep(SequenceBatch.pack([seq, seq]), 0.7))
    assert_same(decode(encode(Ack())), Ack())
