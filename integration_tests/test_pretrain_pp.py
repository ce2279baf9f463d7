"""`mindspeed pretrain` with pipeline parallel: the losses of one process, resume into
another layout, and bad pipeline settings as one line.

Same flow as test_pretrain.py (torchrun on CPU, losses read from metrics.jsonl), with a
shorter run: 6 steps of 4 micro-batches, validation at steps 3 and 6.
"""

import json

import pytest

from mindspeed_core.testing import import_sibling

pretrain = import_sibling(__file__, "test_pretrain")
pytestmark = pytest.mark.distributed
STEPS = 6
SHORT = [f"--train.steps={STEPS}", "--train.eval_interval=3"]


@pytest.fixture(scope="module")
def pp_run(torchrun):
    """`pp_run(nproc, run_dir, *args)`: the short run of this file."""
    return lambda nproc, run_dir, *args: torchrun(nproc, run_dir, *SHORT, *args)


@pytest.fixture(scope="module")
def straight(pp_run, tmp_path_factory):
    """One process, uninterrupted: the reference."""
    return pp_run(1, tmp_path_factory.mktemp("straight"))


def _assert_same_run(records, reference, steps=range(1, STEPS + 1)):
    losses, want = pretrain._losses(records), pretrain._losses(reference)
    assert sorted(losses) == list(steps)
    pretrain._assert_close(losses, want, steps)
    valid = [s for s in (3, 6) if s in steps]
    pretrain._assert_close(
        pretrain._losses(records, "valid_loss"), pretrain._losses(reference, "valid_loss"), valid
    )


@pytest.mark.parametrize(
    ("nproc", "layout"),
    [
        (2, ["--parallel.pp=2"]),
        # 8 microbatches of 1 sample instead of 4 of 2: the schedule re-splits a step
        (2, ["--parallel.pp=2", "--parallel.pp_schedule=GPipe", "--parallel.pp_microbatches=8"]),
        pytest.param(4, ["--parallel.pp=2", "--parallel.dp_shard=2"], marks=pytest.mark.slow),
    ],
    ids=["pp2_1f1b", "pp2_gpipe_8_microbatches", "pp2_dp_shard2"],
)
def test_pipeline_gives_the_losses_of_one_process(straight, pp_run, tmp_path, nproc, layout):
    _assert_same_run(pp_run(nproc, tmp_path / "run", *layout), straight)


def test_a_pp2_checkpoint_resumes_in_one_process(
    straight, pp_run, converts_to_transformers, tmp_path
):
    """... and converts to transformers: both stages' weights are in the checkpoint."""
    run = tmp_path / "pp2"
    first = pp_run(2, run, "--parallel.pp=2", "--train.exit_at_step=3")
    _assert_same_run(first, straight, range(1, 4))
    resumed = pp_run(1, tmp_path / "one", f"--checkpoint.load={run / 'checkpoints' / 'step_3'}")
    _assert_same_run(resumed, straight, range(4, STEPS + 1))
    converts_to_transformers(run / "checkpoints" / "step_3", tmp_path / "hf")


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (["--parallel.pp=4"], ["parallel.pp=4", "4 pipeline stages", "only 2 layers"]),
        (
            ["--parallel.pp=2", "--parallel.layers_per_stage=[2,1]"],
            ["layers_per_stage=[2, 1]", "sum to the model's 2 layers"],
        ),
        (
            ["--parallel.pp=2", "--parallel.virtual_stages=2"],
            ["1F1B runs one stage per rank", "Interleaved1F1B"],
        ),
        (["--parallel.virtual_stages=2"], ["parallel.virtual_stages=2 needs parallel.pp > 1"]),
        (
            [
                "--parallel.pp=2",
                "--parallel.pp_schedule=ZBVZeroBubble",
                "--parallel.virtual_stages=2",
            ]
            + ["--train.ac=full"],
            ["ZBVZeroBubble computes weight gradients", "activation checkpointing"],
        ),
    ],
    ids=[
        "pp_over_layers",
        "layers_per_stage_sum",
        "virtual_stages_with_1f1b",
        "no_pp",
        "zero_bubble_with_recompute",
    ],
)
def test_bad_pipeline_settings_are_one_line(pretrain_cli, tmp_path, args, fragments):
    done = pretrain_cli(tmp_path / "run", *SHORT, *args)
    pretrain._assert_user_error(done, *fragments, tmp_path=tmp_path)


@pytest.mark.slow
def test_fp16_pipeline_gives_the_losses_of_one_process(pp_run, tmp_path):
    """Autocast and loss scaling through the schedule: the loss reported is unscaled."""
    one = pp_run(1, tmp_path / "one", "--train.precision=fp16")
    pp2 = pp_run(2, tmp_path / "pp2", "--train.precision=fp16", "--parallel.pp=2")
    _assert_same_run(pp2, one)


@pytest.mark.slow
def test_interleaved_virtual_stages_with_an_uneven_split(pp_run, tmp_path):
    """4 layers on 4 stages of 2 ranks, split 2 + 1 + 1 + 0 (the last holds only the head)."""
    config = tmp_path / "four" / "config.json"
    config.parent.mkdir()
    config.write_text(
        json.dumps(
            {
                "model_type": "llama",
                "vocab_size": 512,
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_hidden_layers": 4,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "max_position_embeddings": 256,
            }
        )
    )
    model = f"--model.hf_config={config.parent}"
    one = pp_run(1, tmp_path / "one", model)
    layout = [
        "--parallel.pp=2",
        "--parallel.pp_schedule=Interleaved1F1B",
        "--parallel.virtual_stages=2",
        "--parallel.layers_per_stage=[2,1,1,0]",
    ]
    _assert_same_run(pp_run(2, tmp_path / "pp2", model, *layout), one)
