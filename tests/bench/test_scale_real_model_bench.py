"""bench/scale_real_model.py: the whole loop with a chat model of a given shape (tiny here), each process's peak
memory and the steps' times; bench/lora.py runs that job per variant (full weights, LoRA) and sets them side by
side. One run of ``lora.py --quick`` checks both: its full variant is scale_real_model's job and report."""

import json
from pathlib import Path
from types import SimpleNamespace

from tests.bench.conftest import assert_table


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def test_lora_bench_sets_full_and_lora_side_by_side_each_with_the_scale_report(run_bench, tmp_path):
    out = run_bench("lora", "--keep", str(tmp_path), "--ranks", "2")  # scale_real_model's allocation: FSDP2
    # the full variant's report (the first): scale_real_model's job as it is
    memory = {row[0]: float(row[2]) for row in assert_table(out, "process", "count", "peak GiB")}
    assert {"controller", "inference server", "trainer rank 0", "trainer rank 1"} <= set(memory), out
    assert all(0 < gib < 8 for gib in memory.values()), memory
    steps = assert_table(out, "step", "rollout wait", "train", "weight sync")
    assert [row[0] for row in steps] == ["1", "2"]
    assert all(float(row[1]) >= float(row[3]) for row in steps), "a step holds its training"
    summary = json.loads(out.split("summary: ", 1)[1].splitlines()[0])
    assert summary["steps"] == 2 and summary["final_model"].endswith("/full/final")
    # the side-by-side table: one row per variant, sync bytes as measured in the exports the servers loaded
    header = ("variant", "trainer peak GiB", "server peak GiB", "step s", "train s", "export s", "sync s", "sync MiB")
    rows = {row[0]: dict(zip(header, row, strict=False)) for row in assert_table(out.split("side by side")[1], *header)}
    assert list(rows) == ["full", "lora"], out
    for name, row in rows.items():
        assert 0 < float(row["trainer peak GiB"]) < 8 and float(row["server peak GiB"]) > 0, row
        assert float(row["step s"]) >= float(row["train s"]) + float(row["sync s"]) * 0.99, row
        assert float(row["train s"]) > float(row["export s"]) > 0, row  # disk sync: the train call writes the export
        export = tmp_path / "bench" / name / "weights" / "v000002"
        assert abs(float(row["sync MiB"]) * 2**20 - dir_bytes(export)) <= 0.01 * dir_bytes(export), (row, export)
    assert (tmp_path / "bench/full/weights/v000002/model.safetensors").is_file()
    assert (tmp_path / "bench/lora/weights/v000002/adapter_model.safetensors").is_file()
    assert float(rows["lora"]["sync MiB"]) < float(rows["full"]["sync MiB"]) / 2, rows
    assert "lora / full: trainer peak" in out


def test_a_sync_without_a_disk_export_is_measured_by_the_final_export_tensors(tmp_path):
    import lora

    (tmp_path / "final").mkdir()
    (tmp_path / "final" / "adapter_model.safetensors").write_bytes(b"x" * 300)
    (tmp_path / "final" / "adapter_config.json").write_text("{}")
    assert lora.sync_bytes(tmp_path) == (300, "final/*.safetensors")
    for version, size in ((1, 10), (2, 20)):  # disk sync: the last export, every file in it
        (tmp_path / "weights" / f"v{version:06d}").mkdir(parents=True)
        (tmp_path / "weights" / f"v{version:06d}" / "adapter_model.safetensors").write_bytes(b"x" * size)
    (tmp_path / "weights" / "v000002" / "adapter_config.json").write_text("{}")
    assert lora.sync_bytes(tmp_path) == (22, "weights/v000002/")


class FakeProcess:
    """A process whose command line (its role) and resident set size the test sets."""

    def __init__(self, pid: int, children: list | None = None):
        self.pid, self.rss, self.kids = pid, 0, children or []

    def children(self, recursive: bool) -> list:
        return self.kids

    def memory_info(self) -> SimpleNamespace:
        return SimpleNamespace(rss=self.rss)


def test_a_child_sampled_between_its_fork_and_its_exec_counts_as_the_program_it_runs(monkeypatch):
    # the server worker forks the inference server: sampled before the exec, the child still reads as the worker
    # (the role was kept from the first sample, and the memory table had no inference server)
    import scale_real_model as bench

    child = FakeProcess(7)
    root = FakeProcess(1, [child])
    roles = {1: "controller", 7: "server worker"}
    monkeypatch.setattr(bench, "role_of", lambda p: roles[p.pid])
    peaks: dict = {}
    for role, rss in (("server worker", 300), ("inference server", 100), ("inference server", 200), ("?", 50)):
        roles[7], child.rss = role, rss
        bench.sample(root, peaks)
    assert peaks[7] == ("inference server", 200), "the forked copy's size is not the server's"
