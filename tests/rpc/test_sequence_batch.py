"""A train step's batch on the wire: sequences packed into flat tensors (SequenceBatch), raw bytes, not JSON lists.

Round trips are checked value by value and bit by bit (float32 logprobs, float64 advantages); malformed
batches, whether built by a caller or edited on the wire, are refused in one line that names the field.
"""

from __future__ import annotations

import asyncio
import json
import struct

import pytest
import torch

from hpcrl.rpc import DecodeError, RpcClient, decode, encode
from hpcrl.rpc.messages import ComputeLogprobs, ErrorReply, LogprobsResult, SequenceBatch, SequenceData, TrainStep
from hpcrl.rpc.wire import ALIGN, MAGIC
from hpcrl.train.batch import Sequence
from hpcrl.train.service import _sequences
from tests.rpc.conftest import TOKEN, Counting, RawConnection

PRELUDE = struct.Struct(">4sHIQ")


def ragged(lengths=(2, 9, 1, 0, 17), optional=True) -> list[SequenceData]:
    """Sequences of different lengths with float32 logprobs that are not short decimals, ids up to int32's max."""
    gen = torch.Generator().manual_seed(3)
    out = []
    for n, length in enumerate(lengths):
        ids = torch.randint(0, 2**31 - 1, (length,), generator=gen).tolist()
        if length:
            ids[-1] = 2**31 - 1 if n % 2 else -(2**31)
        logprobs = (torch.randn(length, generator=gen) * 3).tolist()  # float32 values, as a server sends them
        mask = [0] + [1] * (length - 1) if length else []
        versions = [-1, *range(length - 1)] if length else []
        prox = (torch.randn(length, generator=gen) / 7).tolist()
        out.append(
            SequenceData(
                ids,
                mask,
                0.1 * (n + 1) - 0.3,  # float64 values that float32 would round
                logprobs if optional else None,
                prox if optional else None,
                None,
                versions if optional else None,
            )
        )
    return out


def bits32(values: list[float]) -> bytes:
    return struct.pack(f"<{len(values)}f", *values)


def split(frame: bytes) -> tuple[dict, bytearray]:
    _, _, header_len, _ = PRELUDE.unpack(frame[: PRELUDE.size])
    return json.loads(frame[PRELUDE.size : PRELUDE.size + header_len]), bytearray(frame[PRELUDE.size + header_len :])


def join(header: dict, data: bytes) -> bytes:
    raw = json.dumps(header).encode()
    raw += b" " * (-(PRELUDE.size + len(raw)) % ALIGN)
    return PRELUDE.pack(MAGIC, 1, len(raw), len(data)) + raw + data


@pytest.mark.parametrize("optional", [True, False])
def test_ragged_batch_round_trips_exactly(optional):
    sequences = ragged(optional=optional)
    out = decode(bytearray(encode(TrainStep(SequenceBatch.pack(sequences), 0.7))))
    back = out.batch.unpack()
    assert back == sequences and [len(s.input_ids) for s in back] == [2, 9, 1, 0, 17]
    for got, sent in zip(back, sequences, strict=True):
        assert type(got.advantage) is float and struct.pack("<d", got.advantage) == struct.pack("<d", sent.advantage)
        assert all(type(i) is int for i in got.input_ids + got.loss_mask)
        if optional:
            assert bits32(got.old_logprobs) == bits32(sent.old_logprobs)
            assert bits32(got.prox_logprobs) == bits32(sent.prox_logprobs)
            assert got.ref_logprobs is None and got.versions == sent.versions
    assert out.batch.lengths.tolist() == [2, 9, 1, 0, 17]


def test_gae_fields_round_trip_bit_for_bit_and_reach_the_engine_rows():
    """PPO with a critic: per-token advantages, returns and the critic's old values travel as float32 bytes and
    become the trainer's Sequence fields of the same names (a field dropped or swapped would differ here)."""
    gen = torch.Generator().manual_seed(5)
    sequences = ragged(lengths=(3, 6), optional=False)
    for seq in sequences:
        n = len(seq.input_ids)
        seq.token_advantages, seq.returns, seq.old_values = (
            (torch.randn(n, generator=gen) * 2).tolist() for _ in range(3)
        )
    out = decode(bytearray(encode(TrainStep(SequenceBatch.pack(sequences), 1.0))))
    assert {out.batch.token_advantages.dtype, out.batch.returns.dtype, out.batch.old_values.dtype} == {torch.float32}
    rows = _sequences(out.batch)
    for row, sent in zip(rows, sequences, strict=True):
        for name in ("token_advantages", "returns", "old_values"):
            assert bits32(getattr(row, name)) == bits32(getattr(sent, name)), name


def test_dtypes_and_layout_on_the_wire():
    batch = decode(encode(ComputeLogprobs(SequenceBatch.pack(ragged()), 1.0))).batch
    dtypes = {name: None if getattr(batch, name) is None else getattr(batch, name).dtype for name in vars(batch)}
    assert dtypes == {
        "lengths": torch.int64,
        "input_ids": torch.int32,
        "loss_mask": torch.bool,
        "advantages": torch.float64,
        "old_logprobs": torch.float32,
        "prox_logprobs": torch.float32,
        "ref_logprobs": None,
        "versions": torch.int32,
        "token_advantages": None,
        "returns": None,
        "old_values": None,
    }
    # sequence 1 starts where sequence 0 (2 tokens) ends, in every per-token tensor
    sequences = ragged()
    assert batch.input_ids[2:11].tolist() == sequences[1].input_ids
    assert batch.old_logprobs[2:11].tolist() == sequences[1].old_logprobs


def test_tokens_travel_as_raw_bytes_not_in_the_json_header():
    small = encode(TrainStep(SequenceBatch.pack(ragged((4, 4))), 1.0))
    big = encode(TrainStep(SequenceBatch.pack(ragged((4000, 4000))), 1.0))
    (small_header, small_data), (big_header, big_data) = split(small), split(big)
    assert len(json.dumps(big_header)) - len(json.dumps(small_header)) < 100  # only shapes, offsets, nbytes grow
    assert len(big_data) - len(small_data) >= 7992 * 16  # 4 bytes of ids, 2 logprobs and versions a token, 1 of mask
    seq = ragged((4000,))[0]
    assert struct.pack(f"<{len(seq.input_ids)}i", *seq.input_ids) in big_data


def test_trainer_gets_the_rows_the_json_path_gave():
    sequences = ragged()
    rows = _sequences(decode(encode(TrainStep(SequenceBatch.pack(sequences), 1.0))).batch)
    assert rows == [Sequence(**vars(s)) for s in sequences]


def test_empty_batch():
    assert decode(encode(TrainStep(SequenceBatch.pack([]), 1.0))).batch.unpack() == []


def _seq(**changes) -> SequenceData:
    fields = dict(
        input_ids=[1, 2, 3],
        loss_mask=[0, 1, 1],
        advantage=1.0,
        old_logprobs=[0.0, -1.0, -2.0],
        prox_logprobs=None,
        ref_logprobs=None,
        versions=[-1, 0, 0],
    )
    return SequenceData(**{**fields, **changes})


@pytest.mark.parametrize(
    "sequences, match",
    [
        ([_seq(), _seq(loss_mask=[0, 1])], "sequence 1: loss_mask must be a list as long as input_ids, got 2"),
        ([_seq(old_logprobs=[0.0])], "sequence 0: old_logprobs must be a list as long as input_ids"),
        ([_seq(), _seq(versions=None)], "sequence 1: has no versions while others have it"),
        ([_seq(loss_mask=[0, 2, 1])], "sequence 0: loss_mask values must be 0 or 1"),
        ([_seq(loss_mask=[0, [1], 1])], "sequence 0: loss_mask values must be 0 or 1"),
        ([_seq(loss_mask=[0, 1.0, 1])], "loss_mask: a value does not fit torch.bool"),
        ([_seq(input_ids=[1, 2**31, 3])], "input_ids: a value does not fit torch.int32"),
        ([_seq(input_ids=[1, 2.0, 3])], "input_ids: a value does not fit torch.int32"),
        ([_seq(old_logprobs=[0.0, "x", 1.0])], "old_logprobs: a value does not fit torch.float32"),
        ([_seq(advantage="1")], "sequence 0: advantage must be a float, got str"),
        ([_seq(), "not a sequence"], "sequence 1: expected SequenceData, got str"),
    ],
)
def test_pack_refuses_what_does_not_fit(sequences, match):
    with pytest.raises(ValueError, match=match.replace("(", r"\(")) as e:
        SequenceBatch.pack(sequences)
    assert "\n" not in str(e.value)


def _tensor_index(header: dict, name: str) -> int:
    return header["body"]["batch"][name]["$tensor"]


def _set_lengths(header: dict, data: bytearray, lengths: list[int]) -> None:
    entry = header["tensors"][_tensor_index(header, "lengths")]
    data[entry["offset"] : entry["offset"] + entry["nbytes"]] = struct.pack(f"<{len(lengths)}q", *lengths)


def _retype(name: str, dtype: str, shape=None):
    def edit(header: dict, _: bytearray) -> None:
        entry = header["tensors"][_tensor_index(header, name)]
        entry["dtype"] = dtype
        entry["shape"] = entry["shape"] if shape is None else shape(entry["shape"])

    return edit


MALFORMED = {
    # the three sequences are 2, 9 and 17 tokens long: 28 in all
    "lengths sum long": (lambda h, d: _set_lengths(h, d, [2, 9, 18]), "input_ids: has 28 entries, expected 29"),
    "lengths sum short": (lambda h, d: _set_lengths(h, d, [2, 9, 1]), "input_ids: has 28 entries, expected 12"),
    "negative length": (lambda h, d: _set_lengths(h, d, [-1, 12, 17]), "lengths: must be >= 0, got -1"),
    "token ids as float": (_retype("input_ids", "float32"), "input_ids: expected a 1-D torch.int32 tensor, got 1-D"),
    "versions as float": (_retype("versions", "float32"), "versions: expected a 1-D torch.int32 tensor"),
    "advantages as int": (_retype("advantages", "int64"), "advantages: expected a 1-D torch.float64 tensor"),
    "lengths as float": (_retype("lengths", "float64"), "lengths: expected a 1-D torch.int64 tensor"),
    "2-D logprobs": (_retype("old_logprobs", "float32", lambda s: [s[0] // 4, 4]), "old_logprobs: expected a 1-D"),
}


def _malformed(case: str) -> bytes:
    edit, _ = MALFORMED[case]
    header, data = split(encode(TrainStep(SequenceBatch.pack(ragged((2, 9, 17))), 1.0)))
    edit(header, data)
    return join(header, bytes(data))


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_batch_is_refused_naming_the_field(case):
    with pytest.raises(DecodeError) as e:
        decode(_malformed(case))
    message = str(e.value)
    assert message.startswith("TrainStep.batch: SequenceBatch rejected its fields") and "\n" not in message
    assert MALFORMED[case][1] in message


def test_a_server_refuses_a_malformed_batch_with_400_and_never_runs_the_handler(serve):
    handler = Counting()
    _, address = serve({"train_step": handler})
    with RawConnection(address) as raw:
        assert raw.hello()[0] == 200
        raw.request("train_step", _malformed("lengths sum short"))
        status, body = raw.reply()
    reply = decode(body, ErrorReply)
    assert status == 400 and reply.error_type == "DecodeError" and "input_ids: has 28 entries" in reply.message
    assert handler.calls == []


def test_a_batch_crosses_a_real_server_bit_exactly(serve):
    handler = Counting()
    _, address = serve({"train_step": handler})
    sequences = ragged()

    async def go():
        async with RpcClient([address], TOKEN) as client:
            return (await client.call("train_step", [TrainStep(SequenceBatch.pack(sequences), 0.5)]))[0]

    echoed = asyncio.run(go())
    received = handler.calls[0].batch.unpack()
    assert received == sequences and echoed.batch.unpack() == sequences
    assert bits32(received[4].old_logprobs) == bits32(sequences[4].old_logprobs)


def test_the_logprobs_reply_is_a_flat_float32_tensor_that_round_trips_exactly():
    rows = [(torch.randn(n, generator=torch.Generator().manual_seed(n)) * 3).tolist() for n in (3, 0, 11, 1)]
    reply = LogprobsResult.of(rows)
    assert reply.lengths.tolist() == [3, 0, 11, 1] and reply.values.dtype == torch.float32
    header, data = split(encode(reply))
    assert str(rows[2][5]) not in json.dumps(header) and bits32(rows[2]) in data, "raw bytes, not JSON numbers"
    assert decode(encode(reply)).per_sequence() == rows  # float32 values, as the engine makes them: exact
    with pytest.raises(ValueError, match=r"values: has 15 entries, expected 14 \(from lengths\)"):
        LogprobsResult(torch.tensor([3, 11]), reply.values)
