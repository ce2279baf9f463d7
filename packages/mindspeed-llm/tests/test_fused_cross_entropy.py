"""The next-token loss through the fused linear + cross-entropy op
(`train.fused_linear_cross_entropy`): the step gives the loss and gradients of logits then
cross entropy (pretraining's every position, SFT's replies with sample normalisation, tied
and padded output rows), while the output layer never runs; `auto` fuses only large
micro-batches, `on` is refused where it cannot run. FSDP and context parallel with it on:
`test_train_step.py`."""

from __future__ import annotations

import copy
import importlib

import pytest
import torch

import mindspeed_llm.train.head as head
from mindspeed_core.errors import ConfigError
from mindspeed_core.optim import OptimConfig
from mindspeed_core.parallel import ParallelConfig
from mindspeed_llm.models import build_model_config
from mindspeed_llm.train.build import build_model, build_train_parts
from mindspeed_llm.train.objectives import LossOutput, NextToken, token_nll
from mindspeed_llm.train.step import TrainStep

ce = importlib.import_module("mindspeed_ops.cross_entropy")  # the package's name is the function


def _batch(seed: int, replies_only: bool):
    """Two packed rows of three documents; labels on every position or on each reply."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 500, (2, 24), generator=gen)
    labels = torch.roll(ids, -1, dims=1)
    bounds = [0, 10, 24, 31, 48]
    flat = labels.view(-1)
    for end in bounds[1:]:
        flat[end - 1] = -100  # no next token across a document's end
    if replies_only:
        for start, end in zip(bounds, bounds[1:], strict=False):
            flat[start : (start + end) // 2] = -100  # the first half: a prompt
    positions = torch.cat([torch.arange(b - a) for a, b in zip(bounds, bounds[1:], strict=False)])
    return {"input_ids": ids, "labels": labels, "position_ids": positions.view(2, 24),
            "cu_seqlens": torch.tensor(bounds, dtype=torch.int32)}  # fmt: skip


def _model(precision="fp32", **overrides):
    config = build_model_config("llama", flavor="debug", **overrides)
    dims = ParallelConfig().dims(1).build("cpu")
    torch.manual_seed(0)
    return build_model(config, dims, torch.device("cpu"), parallel=ParallelConfig(), seq_len=32,
                       precision=precision)  # fmt: skip


def _step(model, objective, fused):
    dims = ParallelConfig().dims(1).build("cpu")
    parts = build_train_parts(model, OptimConfig(lr=1e-3, warmup_steps=0), total_steps=2)
    calls = []
    model.model.output.register_forward_hook(lambda *_: calls.append(1))
    step = TrainStep(parts, objective, dims, clip_grad=0.0, fused_linear_cross_entropy=fused)
    return step, calls


def _run(model, objective, fused, replies_only):
    step, calls = _step(model, objective, fused)
    result = step([_batch(0, replies_only), _batch(1, replies_only)])
    grads = {n: p.grad.clone() for n, p in model.model.named_parameters() if p.grad is not None}
    return result, grads, len(calls)


@pytest.mark.parametrize(
    ("case", "normalization", "replies_only", "overrides"),
    [
        ("pretrain", "token", False, {}),
        ("sft-sample", "sample", True, {}),
        ("tied-padded", "token", False, {"tie_word_embeddings": True, "padded_vocab_size": 519}),
    ],
)
def test_the_fused_loss_equals_logits_then_cross_entropy(case, normalization, replies_only,
                                                         overrides, monkeypatch):  # fmt: skip
    monkeypatch.setitem(ce._LINEAR_CHUNK_ELEMENTS, "cpu", 7 * 512)  # 7-token chunks: 7 of them
    model = _model(**overrides)
    twin = copy.deepcopy(model)
    sft = replies_only  # SFT projects the replies alone, with or without fusing
    plain, plain_grads, projections = _run(
        model, NextToken(normalization, supervised_logits_only=sft), "off", replies_only
    )
    fused, fused_grads, fused_projections = _run(
        twin, NextToken(normalization, supervised_logits_only=sft), "on", replies_only
    )
    assert projections == 2 and fused_projections == 0  # no logits were made when fused
    assert fused.num_units == plain.num_units
    assert fused.loss == pytest.approx(plain.loss, rel=1e-6)
    assert set(fused_grads) == set(plain_grads)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(fused_grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_under_bf16_autocast_the_fused_loss_computes_in_bf16_as_the_projection_does():
    model = _model("bf16")
    twin = copy.deepcopy(model)
    plain, plain_grads, _ = _run(model, NextToken(), "off", False)
    fused, fused_grads, projections = _run(twin, NextToken(), "on", False)
    assert projections == 0
    assert fused.loss == pytest.approx(plain.loss, rel=2e-3)  # bf16 products, fp32 softmax
    for name in ("output.weight", "layers.0.attention.wq.weight"):
        grad, want = fused_grads[name], plain_grads[name]
        assert grad.dtype == torch.float32
        assert (grad - want).norm() <= 0.01 * want.norm(), name  # fp32 sums on our side


def test_auto_fuses_the_micro_batches_whose_logits_are_large(monkeypatch):
    step, calls = _step(_model(), NextToken(), "auto")
    step([_batch(0, False)])
    assert len(calls) == 1  # 48 tokens x 512 x 4 bytes: far below 1 GiB
    monkeypatch.setattr(head, "FUSED_CE_AUTO_BYTES", 48 * 512 * 4)
    step([_batch(0, False)])
    assert len(calls) == 1  # now at the threshold: fused, the output layer did not run


def test_on_is_refused_where_it_cannot_run():
    class ReadsLogits(NextToken):
        def loss(self, outputs, targets, ctx):
            return LossOutput(token_nll(outputs, targets["labels"], ctx) + outputs.mean())

    with pytest.raises(ConfigError, match="loss \\(ReadsLogits\\) reads the logits themselves"):
        _step(_model(), ReadsLogits(), "on")
    step, _ = _step(_model(), ReadsLogits(), "auto")  # auto: not fused, and it trains
    assert step([_batch(0, False)]).loss > 0
    gemma = build_model_config("gemma2", flavor="debug")
    assert gemma.final_logit_softcapping is not None
    dims = ParallelConfig().dims(1).build("cpu")
    model = build_model(gemma, dims, torch.device("cpu"), parallel=ParallelConfig(), seq_len=32)
    with pytest.raises(ConfigError, match="output layer with an adapter, a bias or logit softcap"):
        _step(model, NextToken(), "on")
    with pytest.raises(ConfigError, match="fused_linear_cross_entropy='yes' is not one of"):
        _step(_model(), NextToken(), "yes")
