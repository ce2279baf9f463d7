"""The step profiler: traces named for torch-tb-profiler's loader (parsed by it when
installed), a compute/comm/idle table that sums to the measured step time, comm > 0 only
when there is communication, bad `profile.steps` refused."""

import json
import re
import time

import pytest
import torch
import torch.nn.functional as F

from mindspeed_core.errors import ConfigError
from mindspeed_core.profiling import ProfileConfig, build_profiler, find_traces, format_table
from mindspeed_core.testing import import_sibling, run_distributed

toy = import_sibling(__file__, "toy")
# torch-tb-profiler's consts.WORKER_PATTERN, written out so the test runs without it.
TB_WORKER = re.compile(r"^(.*?)(\.\d+)?\.pt\.trace\.json(?:\.gz)?$")


def _profiled_training(run_dir: str, num_steps: int = 5) -> dict:
    """Train the toy model (FSDP over every rank) with steps 3:4 profiled on every rank;
    the wall time of each step between the loop's `profiler.step()` calls."""
    from mindspeed_core.parallel import ParallelDims, apply_fsdp

    dims = ParallelDims().build()
    model = apply_fsdp(toy.make_model(), dims.mesh("fsdp"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    profiler = build_profiler(
        ProfileConfig(steps="3:4", ranks=[]), rank=rank, device=torch.device("cpu"),
        run_dir=run_dir,
    )  # fmt: skip
    walls, after = {}, time.perf_counter()
    for step, (tokens, labels) in enumerate(toy.make_batches(num_steps), start=1):
        loss = F.cross_entropy(model(tokens).flatten(0, 1), labels.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        before = time.perf_counter()
        walls[step] = (before - after) * 1e3
        profiler.step()
        after = time.perf_counter()
    profiler.close()
    return walls


def _check_run(run_dir, walls_by_rank, world_size):
    traces = find_traces(run_dir)
    assert [t.parent.name for t in traces] == ["profile"] * world_size  # <run>/tb/profile
    assert sorted(TB_WORKER.match(t.name).group(1) for t in traces) == [
        f"rank{r}" for r in range(world_size)
    ]
    summaries = []
    for trace in traces:
        summary = json.loads(trace.with_name(trace.name.split(".")[0] + ".breakdown.json").read_text())
        rank = summary["rank"]
        assert [r["step"] for r in summary["steps"]] == [3, 4]
        for row in summary["steps"]:
            parts = row["compute_ms"] + row["comm_ms"] + row["idle_ms"]
            assert parts == pytest.approx(row["total_ms"], rel=1e-6)
            # the table's step is the loop's step, measured outside the profiler
            assert row["total_ms"] == pytest.approx(walls_by_rank[rank][row["step"]], rel=0.05)
            assert row["compute_ms"] > 0
            assert (row["comm_ms"] > 0) == (world_size > 1)
        assert summary["top_ops"] and summary["top_ops"][0]["self_ms"] > 0
        summaries.append(summary)
    return traces, summaries


def _tb_parse(trace):
    """torch-tb-profiler's own parse of one worker's trace: (step names, step costs)."""
    data_mod = pytest.importorskip("torch_tb_profiler.profiler.data")
    from torch_tb_profiler.profiler.run_generator import RunGenerator

    worker, span = TB_WORKER.match(trace.name).groups()
    data = data_mod.RunProfileData.parse(worker, span[1:], str(trace), str(trace.parent))
    profile = RunGenerator(worker, span[1:], data).generate_run_profile()
    assert {v.name for v in profile.views} >= {"overall", "operator", "trace"}
    return data


@pytest.mark.distributed
def test_profile_dp2_traces_table_and_tb_loader(tmp_path):
    walls = run_distributed(_profiled_training, 2, str(tmp_path))
    traces, summaries = _check_run(tmp_path, walls, 2)
    for trace, summary in zip(traces, summaries, strict=True):
        data = _tb_parse(trace)
        assert len(data.steps_names) == 2 and data.has_communication
        totals = [cost.costs[-1] / 1e3 for cost in data.steps_costs]  # tb: microseconds
        assert totals == pytest.approx([r["total_ms"] for r in summary["steps"]], rel=0.01)
    text = format_table(summaries)
    assert text.splitlines()[1].split()[:2] == ["0", "3"]


def test_profile_one_process_has_no_comm(tmp_path):
    walls = _profiled_training(str(tmp_path))
    _check_run(tmp_path, {0: walls}, 1)


def test_profile_off_and_bad_steps(tmp_path):
    for config in (None, ProfileConfig(), ProfileConfig(steps="1:2", ranks=[1])):
        profiler = build_profiler(config, rank=0, device=torch.device("cpu"), run_dir=tmp_path)
        profiler.step()
        profiler.close()
    # a window already behind a resumed run profiles nothing
    build_profiler(ProfileConfig(steps="1:2"), rank=0, device=torch.device("cpu"),
                   run_dir=tmp_path, start_step=5).close()  # fmt: skip
    assert not list(tmp_path.rglob("*.json"))
    for bad in ("x", "3:2", "0:1", "1:b"):
        with pytest.raises(ConfigError, match="profile.steps"):
            ProfileConfig(steps=bad)
    with pytest.raises(ConfigError, match="profile.ranks"):
        ProfileConfig(steps="1", ranks=[-1])
