"""`train.fp8`: torchao's float8 linear layers in training.

The fp8 arithmetic is torchao's (`Float8Linear`, `torch._scaled_mm`, which recent PyTorch
runs on CPU): these tests check what we add around it. Every decoder linear but the output
head is converted before any parallelism; a few steps of fp32 training with fp8 GEMMs track
the fp32 run within fp8's precision and still differ from it (the GEMMs really are fp8);
FSDP over two ranks gives one process's fp8 losses (within fp8's precision: each rank scales
its own rows' output gradients), and so does tensor parallel (torchao's float8 styles, slow);
tensor parallel of MoE models and a missing torchao are refused in one line.
"""

import builtins

import pytest
import torch
from torch import nn

from mindspeed_core.errors import ConfigError
from mindspeed_core.optim import OptimConfig
from mindspeed_core.parallel import ParallelConfig
from mindspeed_core.testing import run_distributed
from mindspeed_llm.data.collate import lm_batch, split_batch
from mindspeed_llm.models import build_model_config
from mindspeed_llm.train.build import build_model, build_train_parts
from mindspeed_llm.train.objectives import NextToken
from mindspeed_llm.train.step import TrainStep

pytest.importorskip("torchao.float8")
float8_linear = pytest.importorskip("torchao.float8.float8_linear")

ROWS, SEQ, EOD, STEPS = 4, 16, 7, 4


def _batch() -> dict:
    samples = torch.randint(8, 512, (ROWS, SEQ + 1), generator=torch.Generator().manual_seed(0))
    samples[:, 6] = EOD
    return lm_batch(samples, EOD)


def _train(parallel: ParallelConfig, *, fp8: bool, world_size=None):
    """(losses of STEPS steps, {linear name: converted?})."""
    import torch.distributed as dist

    dims = parallel.dims(world_size).build("cpu")
    config = build_model_config("llama", flavor="debug", ops_impl="auto")
    model = build_model(config, dims, torch.device("cpu"), parallel=parallel, seq_len=SEQ, fp8=fp8)
    kinds = {name: isinstance(m, float8_linear.Float8Linear)
             for part in model.parts for name, m in part.named_modules()
             if isinstance(m, nn.Linear)}  # fmt: skip
    parts = build_train_parts(model, OptimConfig(lr=1e-2, warmup_steps=0), total_steps=STEPS)
    step = TrainStep(parts, NextToken(), dims, clip_grad=1.0)
    losses = []
    for _ in range(STEPS):
        batches = split_batch(_batch(), 2)
        if dims.dp_shard > 1:
            batches = [batches[dist.get_rank()]]
        losses.append(step(batches).loss)
    return losses, kinds


def test_fp8_converts_every_linear_but_the_head_and_tracks_fp32():
    fp8_losses, kinds = _train(ParallelConfig(), fp8=True, world_size=1)
    fp32_losses, plain = _train(ParallelConfig(), fp8=False, world_size=1)
    assert kinds.pop("output") is False
    assert kinds and all(kinds.values()), kinds  # wq..wo, w1..w3 of every block
    assert not any(plain.values())
    assert fp8_losses == pytest.approx(fp32_losses, rel=2e-2)
    assert fp8_losses[0] != pytest.approx(fp32_losses[0], rel=1e-6)  # really fp8 GEMMs
    assert fp8_losses[-1] < fp8_losses[0] - 0.1  # it trains


@pytest.mark.distributed
@pytest.mark.slow
def test_fp8_under_fsdp_gives_one_process_losses():
    one, _ = _train(ParallelConfig(), fp8=True, world_size=1)
    (sharded, kinds), _ = run_distributed(_train, 2, ParallelConfig(dp_shard=2), fp8=True,
                                          timeout=300)  # fmt: skip
    assert all(v for k, v in kinds.items() if k != "output")
    assert sharded == pytest.approx(one, rel=2e-2)


def _forward_losses(parallel: ParallelConfig, world_size=None):
    """fp8 losses of three forwards (no backward) and which layers took float8 styles."""
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel  # noqa: F401

    dims = parallel.dims(world_size).build("cpu")
    config = build_model_config("llama", flavor="debug", ops_impl="auto")
    model = build_model(config, dims, torch.device("cpu"), parallel=parallel, seq_len=SEQ, fp8=True)
    parts = build_train_parts(model, OptimConfig(lr=1e-2, warmup_steps=0), total_steps=1)
    step = TrainStep(parts, NextToken(), dims)
    return [step.evaluate([split_batch(_batch(), 2)]) for _ in range(3)]


@pytest.mark.distributed
@pytest.mark.slow
def test_fp8_under_tensor_parallel_gives_one_process_forward():
    """tp=2 (+ sequence parallel): the converted layers take torchao's float8 styles
    (`float8_plan`), the head stays high precision, and the forward's losses are one process's
    within fp8's precision. The backward casts gradients to float8 before their collectives,
    which gloo cannot carry: that half needs NCCL and two GPUs, and has not run."""
    one = _forward_losses(ParallelConfig(), world_size=1)
    results = run_distributed(_forward_losses, 2, ParallelConfig(tp=2, sequence_parallel=True),
                              timeout=300)  # fmt: skip
    for losses in results:
        assert losses == pytest.approx(one, rel=2e-2)


def test_float8_plan_swaps_the_styles_of_converted_layers_only():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

    from mindspeed_core.fp8 import convert_fp8, float8_plan

    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 16), nn.Linear(16, 10))
    convert_fp8(model, skip=())  # 16 x 10 cannot be converted
    plan = {"0": ColwiseParallel(), "1": RowwiseParallel(output_layouts=None), "2": ColwiseParallel()}
    swapped = float8_plan(plan, model)
    assert type(swapped["0"]) is Float8ColwiseParallel and type(swapped["1"]) is Float8RowwiseParallel
    assert swapped["2"] is plan["2"]  # a layer left in high precision keeps its style
    assert swapped["1"].output_layouts == plan["1"].output_layouts


def test_fp8_refuses_tensor_parallel_of_moe_and_a_missing_torchao(monkeypatch):
    from mindspeed_core.fp8 import convert_fp8
    from mindspeed_llm.models.common.parallelize import parallelize_decoder

    class FakeDims:  # only what parallelize_decoder reads before refusing
        tp = 2

    model = nn.Module()
    model.tok_embeddings = model.output = None
    model.config = build_model_config("mixtral", flavor="debug")
    with pytest.raises(ConfigError, match=r"train\.fp8 with parallel\.tp=2: .*dense attention"):
        parallelize_decoder(model, FakeDims(), fp8=True)

    real_import = builtins.__import__

    def no_torchao(name, *args, **kwargs):
        if name.startswith("torchao"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_torchao)
    with pytest.raises(ConfigError, match=r"pip install 'mindspeed-core\[fp8\]'"):
        convert_fp8(nn.Sequential(nn.Linear(16, 16)))


def test_fp8_needs_a_layer_it_can_convert():
    from mindspeed_core.fp8 import convert_fp8

    with pytest.raises(ConfigError, match="divisible by 16"):
        convert_fp8(nn.Sequential(nn.Linear(10, 16), nn.Linear(16, 10)))
