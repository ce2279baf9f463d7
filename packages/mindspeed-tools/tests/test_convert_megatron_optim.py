"""`mindspeed convert --from megatron --to mindspeed --with-optimizer`: Megatron-Core's own
optimizer (`get_megatron_optimizer`, Adam, fp32, not distributed; torch's AdamW, since
neither Apex nor Transformer Engine is installed) trains the tiny GPTModel of
test_convert_megatron at tp=2 for two iterations under Megatron's `OptimizerParamScheduler`
and saves it as Megatron-LM does with `--ckpt-format torch_dist`
(`{"model": sharded_state_dict, "optimizer": optimizer.sharded_state_dict(model_sd), ...}`);
our converted checkpoint holds Megatron's moments bit for bit and its step count, and our
optimizer, resumed from it, makes Megatron's third update on the same batch.

Megatron-Core's optimizer runs on CPU with one concession beyond the model's (see
test_convert_megatron): `torch.tensor` / `torch.zeros` given device="cuda" make CPU tensors
(FP32Optimizer's loss scale and the grad-norm's overflow buffer name "cuda" literally).
"""

from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

from mindspeed_core.checkpoint import ModelState, TrainState
from mindspeed_core.cli import run as cli
from mindspeed_core.optim import build_lr_schedulers, build_optimizers
from mindspeed_core.testing import import_sibling, run_distributed
from mindspeed_llm.hf_export.dcp_stream import load_streaming
from mindspeed_llm.loading import load_model
from mindspeed_llm.models.registry import get_model_spec
from mindspeed_llm.train.run_dir import resume
from mindspeed_tools.convert import megatron
from mindspeed_tools.convert.megatron.mapping import tp_merge

pytest.importorskip("megatron.core")
mm = import_sibling(__file__, "test_convert_megatron")

ITERATIONS, LR, WD, BETAS, EPS = 2, 1e-3, 0.1, (0.9, 0.95), 1e-8


def _on_cpu(make):
    def made(*args, **kwargs):
        if kwargs.get("device") == "cuda":
            kwargs["device"] = "cpu"
        return make(*args, **kwargs)

    return made


def _batch(seed: int) -> torch.Tensor:
    """(2, SEQ + 1) tokens: inputs are [:, :-1], labels [:, 1:]."""
    return torch.randint(
        0, mm.VOCAB, (2, mm.SEQ + 1), generator=torch.Generator().manual_seed(seed)
    )


def _train_save_step(out: str, tp: int):
    """One rank: ITERATIONS Adam steps on batch 0, saved (torch_dist) at that iteration; then
    one more on batch 1, saved into `out/after`. Returns this rank's exp_avg / exp_avg_sq
    by parameter name (the rank's shards) and the tp dim layout for the merge."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    initialize_rng_tracker(inference_rng_tracker=True)
    torch.manual_seed(1234)
    config = mm._megatron_config(tp, 1)
    positions = torch.arange(mm.SEQ).expand(2, mm.SEQ)
    causal = torch.triu(torch.ones(mm.SEQ, mm.SEQ, dtype=torch.bool), 1)[None, None]
    with (
        mock.patch("torch.cuda.current_device", return_value="cpu"),
        mock.patch("torch.cuda.synchronize"),
        mock.patch("torch.tensor", _on_cpu(torch.tensor)),
        mock.patch("torch.zeros", _on_cpu(torch.zeros)),
    ):
        model = mm._gpt(config, None, True, True).train()
        mm._perturb(model)
        ddp = DistributedDataParallel(config, DistributedDataParallelConfig(), model)
        optim_config = OptimizerConfig(
            optimizer="adam",
            lr=LR,
            min_lr=LR,
            weight_decay=WD,
            adam_beta1=BETAS[0],
            adam_beta2=BETAS[1],
            adam_eps=EPS,
            clip_grad=0.0,
        )
        optimizer = get_megatron_optimizer(optim_config, [ddp])
        # Megatron-LM's schedule object also applies wd_mult (no decay for norms)
        scheduler = OptimizerParamScheduler(
            optimizer,
            init_lr=LR,
            max_lr=LR,
            min_lr=LR,
            lr_warmup_steps=0,
            lr_decay_steps=10,
            lr_decay_style="constant",
            start_wd=WD,
            end_wd=WD,
            wd_incr_steps=10,
            wd_incr_style="constant",
        )

        def train_step(batch: torch.Tensor) -> None:
            ddp.zero_grad_buffer()
            optimizer.zero_grad()
            loss = ddp(batch[:, :-1], positions, causal, labels=batch[:, 1:]).mean()
            loss.backward()
            ddp.finish_grad_sync()
            assert optimizer.step()[0]
            scheduler.step(increment=1)

        for _ in range(ITERATIONS):
            train_step(_batch(0))
        moments = {
            kind: {
                n: optimizer.chained_optimizers[0].optimizer.state[p][kind].clone()
                for n, p in model.named_parameters()
            }
            for kind in ("exp_avg", "exp_avg_sq")
        }
        _save(model, optimizer, Path(out) / "megatron", tp, ITERATIONS)
        train_step(_batch(1))
        _save(model, optimizer, Path(out) / "after", tp, ITERATIONS + 1)
    return moments


def _save(model, optimizer, root: Path, tp: int, iteration: int) -> None:
    """As Megatron-LM's save_checkpoint with --ckpt-format torch_dist (the unwrapped model's
    sharded state dict, the optimizer's built on it)."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    args = mm._megatron_args(tp, 1)
    args.ckpt_format = "torch_dist"
    folder = root / f"iter_{iteration:07d}"
    folder.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    model_sd = model.sharded_state_dict()
    state = {
        "args": args,
        "checkpoint_version": 3.0,
        "iteration": iteration,
        "model": model_sd,
        "optimizer": optimizer.sharded_state_dict(model_sd),
    }
    dist_checkpointing.save(state, str(folder))
    dist.barrier()
    if dist.get_rank() == 0:
        (root / "latest_checkpointed_iteration.txt").write_text(f"{iteration}\n")


def _cli(capsys, *args) -> tuple[int, str]:
    code = cli(["convert", *map(str, args)])
    return code, capsys.readouterr().err.strip()


def _megatron_moments_as_hf(ranks: list[dict], config: dict) -> dict[str, dict[str, torch.Tensor]]:
    """Each rank's moments merged over tp as the legacy reader merges weights, in HF names."""
    merged = {}
    for kind in ("exp_avg", "exp_avg_sq"):
        names = ranks[0][kind]
        whole = {n: tp_merge(n, [r[kind][n] for r in ranks]) for n in names}
        merged[kind] = megatron.to_hf_tensors(whole, config, Path("megatron"))
    return merged


def _our_optimizer_state(folder: Path, names: dict) -> dict[str, torch.Tensor]:
    got = {}
    load_streaming(folder, names, got.__setitem__)
    return got


@pytest.mark.slow
def test_megatron_adam_state_converts_bit_for_bit_and_training_goes_on(tmp_path, capsys):
    ranks = run_distributed(_train_save_step, 2, str(tmp_path), 2, timeout=300)
    ours = tmp_path / "ours"
    code, err = _cli(
        capsys,
        "--input",
        tmp_path / "megatron",
        "--output",
        ours,
        "--to",
        "mindspeed",
        "--tp",
        2,
        "--with-optimizer",
    )
    assert code == 0, err
    assert (ours / "latest").read_text() == f"step_{ITERATIONS}\n"
    model, config = load_model(ours, dtype=torch.float32)
    names = dict(model.named_parameters())
    step_dir = ours / f"step_{ITERATIONS}"

    # exp_avg / exp_avg_sq of every parameter are Megatron's, bit for bit; step carried
    hf_config = megatron.hf_config(vars(mm._megatron_args(2, 1)), tmp_path)
    want = _megatron_moments_as_hf(ranks, hf_config)
    adapter = get_model_spec(config.family).hf_adapter
    for kind in ("exp_avg", "exp_avg_sq"):
        keys = {
            f"optimizer.state.{n}.{kind}": (torch.float32, tuple(p.shape)) for n, p in names.items()
        }
        saved = _our_optimizer_state(step_dir, keys)
        state = {k.split(".", 2)[2].rsplit(".", 1)[0]: t for k, t in saved.items()}
        got = adapter.to_hf(state, config)
        assert got.keys() == want[kind].keys()
        for name, tensor in got.items():
            assert torch.equal(tensor, want[kind][name]), (kind, name)
    steps = _our_optimizer_state(
        step_dir, {f"optimizer.state.{n}.step": (torch.float32, ()) for n in names}
    )
    assert {float(t) for t in steps.values()} == {float(ITERATIONS)}

    # our optimizer, resumed from it, makes Megatron's third update on batch 1
    optimizer = build_optimizers(model, lr=LR, weight_decay=WD, betas=BETAS, eps=EPS)
    scheduler = build_lr_schedulers(
        optimizer, warmup_steps=0, total_steps=10, decay_style="constant"
    )
    train = TrainState()
    states = {
        "model": ModelState(model),
        "optimizer": optimizer,
        "scheduler": scheduler,
        "train": train,
    }
    empty = mock.Mock(latest_step=mock.Mock(return_value=None))  # a new run's own folder
    assert resume(empty, str(ours), states) == ITERATIONS
    assert train.step == ITERATIONS and scheduler.schedulers[0].last_epoch == ITERATIONS
    batch = _batch(1)
    logits = model(batch[:, :-1])
    F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).backward()
    optimizer.step()
    after, _ = load_model(
        _converted(tmp_path / "after", tmp_path / "after_ours", capsys), dtype=torch.float32
    )
    expected = dict(after.named_parameters())
    for name, param in model.named_parameters():
        torch.testing.assert_close(param, expected[name], atol=1e-5, rtol=0, msg=name)


def _converted(source: Path, out: Path, capsys) -> Path:
    code, err = _cli(capsys, "--input", source, "--output", out, "--to", "mindspeed")
    assert code == 0, err
    return out


# -- bad input: one line, exit 2, nothing written ---------------------------------------


def _torch_dist(root: Path, common: dict, optimizer_keys=()) -> None:
    """A torch_dist save as Megatron lays it out (DCP tensors, common.pt), written here."""
    import torch.distributed.checkpoint as dcp

    folder = root / "iter_0000001"
    name = "embedding.word_embeddings.weight"
    tensors = {key: torch.zeros(mm.VOCAB, mm.HIDDEN) for key in (name, *optimizer_keys)}
    dcp.save(tensors, checkpoint_id=str(folder), no_dist=True)
    args = mm._megatron_args(1, 1)
    args.ckpt_format = "torch_dist"
    torch.save({"args": args, "iteration": 1, **common}, folder / "common.pt")
    (root / "latest_checkpointed_iteration.txt").write_text("1\n")


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("no_optimizer", "common.pt holds no optimizer state"),
        ("distributed", "the distributed optimizer's state (param_state_sharding_type="),
        ("no_moments", "its .metadata holds no optimizer.state.exp_avg.*"),
        ("mixed_precision", "optimizer.state.fp32_param.embedding.word_embeddings.weight: mixed"),
        ("legacy", "mp_rank_00/model_optim_rng.pt: --with-optimizer converts torch_dist"),
    ],
)
def test_with_optimizer_refuses_what_it_cannot_carry(tmp_path, capsys, case, expected):
    root = tmp_path / "megatron"
    if case == "legacy":
        mm._rank_file(root, "mp_rank_00", mm._megatron_args(1, 1))
    else:
        optimizer = {
            "no_optimizer": None,
            "distributed": {"param_state_sharding_type": "dp_reshardable", "param_groups": []},
            "no_moments": {"state": {"common_step": torch.tensor(1.0)}, "param_groups": []},
            "mixed_precision": {"state": {}, "param_groups": [{"step": 1}]},
        }[case]
        keys = (
            [
                f"optimizer.state.{k}.embedding.word_embeddings.weight"
                for k in ("exp_avg", "exp_avg_sq", "fp32_param")
            ]
            if case == "mixed_precision"
            else []
        )
        _torch_dist(root, {} if optimizer is None else {"optimizer": optimizer}, keys)
    code, err = _cli(
        capsys,
        "--input",
        root,
        "--output",
        tmp_path / "out",
        "--to",
        "mindspeed",
        "--with-optimizer",
    )
    assert code == 2 and len(err.splitlines()) == 1 and expected in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["megatron"]


@pytest.mark.parametrize("flags", [("--to", "hf"), ("--from", "hf", "--to", "mindspeed")])
def test_with_optimizer_applies_to_megatron_to_mindspeed_only(tmp_path, capsys, flags):
    root = tmp_path / "megatron"
    mm._rank_file(root, "mp_rank_00", mm._megatron_args(1, 1))
    code, err = _cli(
        capsys, "--input", root, "--output", tmp_path / "out", *flags, "--with-optimizer"
    )
    assert code == 2 and err == (
        "error: --with-optimizer applies to --from megatron --to mindspeed only"
    ), err
