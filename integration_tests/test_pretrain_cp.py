"""`mindspeed pretrain` under context parallel: ring and Ulysses over 2 processes, hybrid
2 x 2, dp_shard=2 x cp=2 and tp=2 (sequence and loss parallel) x cp=2 over 4 give the
losses of one process (packed demo documents, zig-zag per document), and bad layouts are
one line naming the values, before any process group."""

import pytest

from mindspeed_core.testing import import_sibling

pretrain = import_sibling(__file__, "test_pretrain")
pytestmark = pytest.mark.distributed
STEPS = 6
SHORT = [f"--train.steps={STEPS}", "--train.eval_interval=3"]


@pytest.fixture(scope="module")
def one_process(torchrun, tmp_path_factory):
    return torchrun(1, tmp_path_factory.mktemp("one"), *SHORT)


_SLOW = pytest.mark.slow  # four processes: CI runs them while its time budget holds


@pytest.mark.parametrize(
    ("nproc", "layout"),
    [
        (2, ["--parallel.cp=2", "--parallel.cp_mode=ring"]),
        (2, ["--parallel.cp=2", "--parallel.cp_mode=ulysses"]),
        pytest.param(
            4,
            ["--parallel.cp=4", "--parallel.cp_mode=hybrid", "--parallel.ulysses_degree=2"],
            marks=_SLOW,
        ),
        pytest.param(4, ["--parallel.cp=2", "--parallel.dp_shard=2"], marks=_SLOW),
        pytest.param(
            4,
            ["--parallel.cp=2", "--parallel.tp=2", "--parallel.sequence_parallel=true"],
            marks=_SLOW,
        ),
    ],
    ids=["ring", "ulysses", "hybrid_2x2", "dp_shard2_cp2", "tp2_sp_loss_parallel_cp2"],
)
def test_cp_gives_the_losses_of_one_process(one_process, torchrun, tmp_path, nproc, layout):
    records = torchrun(nproc, tmp_path / "run", *SHORT, *layout)
    want = pretrain._losses(one_process)
    assert sorted(want) == list(range(1, STEPS + 1))
    pretrain._assert_close(pretrain._losses(records), want, range(1, STEPS + 1))
    valid = pretrain._losses(one_process, "valid_loss")
    pretrain._assert_close(pretrain._losses(records, "valid_loss"), valid, (3, 6))


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (["--parallel.cp=2", "--data.seq_len=62"], ["data.seq_len=62", "2 x parallel.cp = 4"]),
        (
            ["--parallel.cp=8", "--parallel.cp_mode=ulysses"],
            ["parallel.cp=8", "num_heads divisible by 8, got num_heads=4"],
        ),
        (
            ["--parallel.cp=4", "--parallel.cp_mode=hybrid", "--parallel.ulysses_degree=3"],
            ["parallel.ulysses_degree dividing parallel.cp=4, got 3"],
        ),
    ],
    ids=["seq_len", "heads", "ulysses_degree"],
)
def test_bad_context_parallel_layouts_are_one_line(pretrain_cli, tmp_path, args, fragments):
    done = pretrain_cli(tmp_path / "run", *args)
    pretrain._assert_user_error(done, *fragments, tmp_path=tmp_path)
