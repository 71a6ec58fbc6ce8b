"""The weight-update group's rank arithmetic and a push's buckets (pure functions, no torch)."""

import subprocess
import sys

import pytest

from hpcrl.inference.weight_layout import buckets, group_layout, spec_bytes


def test_every_tensor_parallel_rank_of_every_server_has_a_rank_after_the_trainers():
    assert group_layout([2, 2]) == (5, [1, 3])
    assert group_layout([1, 4, 2]) == (8, [1, 2, 6])
    for bad in ([], [0], [2, True]):
        with pytest.raises(ValueError, match="tp_sizes"):
            group_layout(bad)


def test_buckets_keep_the_order_and_bound_each_calls_bytes():
    specs = [("a", "bfloat16", [8]), ("b", "bfloat16", [8]), ("big", "float32", [100]), ("c", "bfloat16", [4, 2])]
    assert spec_bytes(specs) == 16 + 16 + 400 + 16
    calls = buckets(specs, 32)
    assert calls == [specs[:2], [specs[2]], [specs[3]]], "a tensor over the bound goes alone, in its place"
    assert [s for call in calls for s in call] == specs
    assert all(spec_bytes(call) <= 32 for call in calls if len(call) > 1)
    with pytest.raises(ValueError, match="unknown dtype 'float33'"):
        spec_bytes([("x", "float33", [1])])


def test_the_client_side_imports_no_torch():
    """Every process that only speaks HTTP (the server worker, rollout workers) would pay seconds for it."""
    code = "import sys, hpcrl.inference.client, hpcrl.inference.worker; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"
