"""`mindspeed pretrain` of a MoE model: expert parallel over 2 processes gives the losses of
one process, router statistics reach metrics.jsonl, a checkpoint saved with ep=2 resumes
in one process exactly and converts to a transformers Mixtral with the same logits, and a
bad ep is one line."""

import pytest

from mindspeed_core.testing import import_sibling

pretrain = import_sibling(__file__, "test_pretrain")
pytestmark = pytest.mark.distributed
STEPS = 6
MIXTRAL = [
    "--model.family=mixtral",
    "--model.flavor=debug",
    f"--train.steps={STEPS}",
    "--train.eval_interval=3",
]


@pytest.fixture(scope="module")
def one(torchrun, tmp_path_factory):
    """One process, no interruption: the reference."""
    return torchrun(1, tmp_path_factory.mktemp("one"), *MIXTRAL)


def test_ep2_gives_the_losses_of_one_process_and_logs_router_statistics(torchrun, tmp_path, one):
    ep2 = torchrun(2, tmp_path / "ep2", *MIXTRAL, "--parallel.ep=2")
    losses = pretrain._losses(one)
    assert sorted(losses) == list(range(1, STEPS + 1))
    pretrain._assert_close(pretrain._losses(ep2), losses, range(1, STEPS + 1))
    valid = pretrain._losses(one, "valid_loss")
    pretrain._assert_close(pretrain._losses(ep2, "valid_loss"), valid, (3, 6))
    pretrain._assert_close(
        pretrain._losses(ep2, "moe_aux_loss"),
        pretrain._losses(one, "moe_aux_loss"),
        range(1, STEPS + 1),
    )
    for record in ep2:
        load = record["moe_load"]  # (layers, experts) fractions of the step's assignments
        assert len(load) == 2 and all(len(row) == 4 for row in load)
        assert all(sum(row) == pytest.approx(1.0, abs=1e-3) for row in load)
        assert record["moe_max_load"] >= 1.0 >= record["moe_min_load"] >= 0.0
        assert record["moe_aux_loss"] > 0 and record["moe_dropped_tokens"] == 0
    assert [r["moe_load"] for r in ep2] == [r["moe_load"] for r in one]


def _assert_same_moe_run(run, reference):
    """Losses, aux losses and expert loads of `run` are those of `reference`."""
    steps = range(1, STEPS + 1)
    for key in ("loss", "moe_aux_loss"):
        pretrain._assert_close(pretrain._losses(run, key), pretrain._losses(reference, key), steps)
    loads = [[r["moe_load"] for r in records if "moe_load" in r] for records in (run, reference)]
    assert len(loads[0]) == STEPS
    for got, want in zip(*loads, strict=True):
        flat = [v for row in want for v in row]
        assert [v for row in got for v in row] == pytest.approx(flat, abs=2e-4)


@pytest.mark.slow  # the layout itself: test_models_moe_layouts.py (not slow)
def test_tp2_with_sequence_parallel_gives_the_losses_of_one_process(torchrun, tmp_path, one):
    """Routed experts whole on both tp ranks, attention split, the sequence gathered."""
    tp2 = torchrun(
        2, tmp_path / "tp2", *MIXTRAL, "--parallel.tp=2", "--parallel.sequence_parallel=true"
    )
    _assert_same_moe_run(tp2, one)


@pytest.mark.slow
def test_pp2_gives_the_losses_of_one_process(torchrun, tmp_path):
    """Each stage's blocks attach their aux loss; loads summed over the stages."""
    per_layer = [*MIXTRAL, "--model.router_aux_loss_scope=layer"]
    reference = torchrun(1, tmp_path / "one", *per_layer)
    _assert_same_moe_run(torchrun(2, tmp_path / "pp2", *per_layer, "--parallel.pp=2"), reference)


@pytest.mark.slow
def test_an_ep2_checkpoint_resumes_in_one_process(
    torchrun, converts_to_transformers, tmp_path, one
):
    run = tmp_path / "ep2"
    first = torchrun(2, run, *MIXTRAL, "--parallel.ep=2", "--train.exit_at_step=3")
    assert max(pretrain._losses(first)) == 3
    step_3 = run / "checkpoints" / "step_3"
    resumed = torchrun(1, tmp_path / "one", *MIXTRAL, f"--checkpoint.load={step_3}")
    assert min(pretrain._losses(resumed)) == 4
    pretrain._assert_close(pretrain._losses(resumed), pretrain._losses(one), range(4, STEPS + 1))
    hf, config = converts_to_transformers(step_3, tmp_path / "hf")
    assert type(hf).__name__ == "MixtralForCausalLM" and config.num_experts == 4


def test_ep_not_dividing_the_data_ranks_is_one_line(pretrain_cli, tmp_path):
    done = pretrain_cli(tmp_path / "run", *MIXTRAL, "--parallel.ep=2")
    pretrain._assert_user_error(done, "ep=2 must divide dp_shard x cp = 1", tmp_path=tmp_path)


DEEPSEEK = ["--model.family=deepseek_v3", "--model.flavor=debug", f"--train.steps={STEPS}"]


def test_deepseek_v3_trains_with_mtp_and_ep2_gives_one_process_losses(torchrun, tmp_path):
    """The debug DeepSeek-V3 (latent attention, grouped sigmoid routing with the aux-free
    bias, one MTP module) trains through the CLI: the loss falls, the MTP loss and the
    expert loads of its 2 MoE blocks and the MTP block reach metrics.jsonl; experts over
    ep=2 (MTP block's too, FSDP over the rest) give one process's losses."""
    one = torchrun(1, tmp_path / "one", *DEEPSEEK)
    losses = pretrain._losses(one)
    assert sorted(losses) == list(range(1, STEPS + 1)) and losses[STEPS] < losses[1]
    for record in one:
        if "loss" in record:
            assert 0 < record["mtp_loss"] < 0.1 * 7  # mtp_loss_scale 0.1 x CE over 512 tokens
            assert len(record["moe_load"]) == 3 and len(record["moe_load"][0]) == 8
    ep2 = torchrun(2, tmp_path / "ep2", *DEEPSEEK, "--parallel.ep=2")
    for key in ("loss", "mtp_loss"):
        pretrain._assert_close(
            pretrain._losses(ep2, key), pretrain._losses(one, key), range(1, STEPS + 1)
        )


@pytest.mark.slow
def test_deepseek_v3_with_mtp_under_tp2_cp2_and_pp2_gives_one_process_losses(torchrun, tmp_path):
    """Multi-token prediction through the CLI under each model-parallel layout: tp=2, cp=2
    (the tokens ahead looked up over cp) and pp=2 (the MTP module on the last stage) give
    one process's losses and MTP losses (metrics.jsonl, step by step)."""
    one = torchrun(1, tmp_path / "one", *DEEPSEEK)
    for name in ("tp", "cp", "pp"):
        run = torchrun(2, tmp_path / name, *DEEPSEEK, f"--parallel.{name}=2")
        for key in ("loss", "mtp_loss"):
            pretrain._assert_close(
                pretrain._losses(run, key), pretrain._losses(one, key), range(1, STEPS + 1)
            )
