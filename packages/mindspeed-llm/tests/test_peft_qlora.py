"""QLoRA: a model whose base is stored in NF4 is LoRA on the NF4-dequantised base (logits
and adapter gradients, fp32, 1e-5; the dequantised values from the reference op, itself
checked against torchao in mindspeed-ops); the base weights take <= 0.3x their bf16 bytes;
what NF4 cannot serve is one line; 50 steps of QLoRA end within 2% of LoRA's loss (slow)."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from mindspeed_core.config import load_config
from mindspeed_core.distributed import destroy_distributed, init_distributed
from mindspeed_core.errors import ConfigError
from mindspeed_core.training import read_metrics
from mindspeed_llm.models import Transformer, build_model_config
from mindspeed_llm.peft import LoRAConfig, adapted_modules, apply_lora, lora_trainer_options
from mindspeed_llm.peft.qlora import base_weight_bytes, quantize_base
from mindspeed_llm.train.config import PretrainConfig
from mindspeed_llm.train.trainer import Trainer
from mindspeed_ops import nf4_dequantize_reference, nf4_quantize_reference


def config():
    base = build_model_config("llama", flavor="debug", ops_impl="reference")
    return dataclasses.replace(base, hidden_size=128, intermediate_size=256, head_dim=32)


def _model(quantize: bool):
    torch.manual_seed(0)
    model = Transformer(config())
    model.init_weights()
    apply_lora(model, LoRAConfig(rank=4, alpha=8))
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for _, linear in adapted_modules(model):
            linear.lora_B.weight.copy_(torch.randn(linear.lora_B.weight.shape, generator=gen))
            if not quantize:  # the oracle: the same base, NF4-dequantised by the reference
                packed, absmax = nf4_quantize_reference(linear.weight)
                linear.weight.copy_(
                    nf4_dequantize_reference(packed, absmax, linear.weight.shape, torch.float32)
                )
    if quantize:
        assert len(quantize_base(model)) == 7 * model.config.num_layers
    return model


def test_qlora_is_lora_on_the_nf4_base_and_stores_it_in_under_0_3x_bf16():
    x = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(1))
    results = []
    for quantize in (True, False):
        model = _model(quantize)
        logits = model(x)
        F.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten()).backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
        results.append((logits.detach(), grads, model))
    (q_logits, q_grads, qlora), (logits, grads, _) = results
    torch.testing.assert_close(q_logits, logits, atol=1e-5, rtol=1e-5)
    assert q_grads.keys() == grads.keys() and len(grads) == 2 * 7 * 2
    for name, grad in grads.items():
        torch.testing.assert_close(q_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)
    assert not any("weight_nf4" in k for k in qlora.state_dict())  # never checkpointed
    assert not hasattr(qlora.layers["0"].attention.wq, "weight")  # dropped after forward
    stored, bf16 = base_weight_bytes(qlora)
    assert stored / bf16 <= 0.3, stored / bf16


def test_what_nf4_cannot_serve_is_one_line():
    lora = LoRAConfig(rank=4, quantize="nf4")
    with pytest.raises(ConfigError, match="train.precision=fp16 cannot serve it"):
        lora_trainer_options(lora, precision="fp16", device_type="cpu")
    with pytest.raises(ConfigError, match="no NF4 kernel on device 'mps'"):
        lora_trainer_options(lora, precision="bf16", device_type="mps")
    with pytest.raises(ConfigError, match="lora.quantize='nf8': choose none or nf4"):
        LoRAConfig(rank=4, quantize="nf8")
    with pytest.raises(ConfigError, match="needs adapters: set lora.rank > 0"):
        LoRAConfig(quantize="nf4")
    assert set(lora_trainer_options(lora, precision="bf16")) == {"after_tp", "adapter_only"}


@dataclasses.dataclass(kw_only=True)
class LoRAPretrainConfig(PretrainConfig):
    """Pretraining with a `lora` section (what `mindspeed sft` takes as `lora:`)."""

    lora: LoRAConfig = dataclasses.field(default_factory=LoRAConfig)
    """Adapters; rank 0: full training."""


def _run(tmp_path, name, quantize):
    args = ["--train.steps=50", "--train.micro_batch=4", "--train.global_batch=4",
            "--data.seq_len=64", "--optim.warmup_steps=5", "--optim.lr=3e-3",
            "--train.eval_interval=0", "--checkpoint.interval=0", "--logging.log_interval=1",
            "--logging.progress=false", "--logging.tensorboard=false",
            "--model.ops_impl=reference", f"--logging.run_dir={tmp_path / name}",
            "--lora.rank=8", "--lora.alpha=16", f"--lora.quantize={quantize}"]  # fmt: skip
    cfg = load_config(LoRAPretrainConfig, None, args)
    info = init_distributed(device_type="cpu")
    options = lora_trainer_options(cfg.lora, precision=cfg.train.precision, device_type="cpu")
    try:
        Trainer(cfg, info, **options).run()
    finally:
        destroy_distributed()
    return [r["loss"] for r in read_metrics(tmp_path / name / "metrics.jsonl")]


@pytest.mark.slow
def test_qlora_trains_within_2_percent_of_lora_after_50_steps(tmp_path, monkeypatch):
    """The pretrain demo's corpus on the debug Llama (its seed's base): the mean loss of the
    last 5 of 50 steps, QLoRA against LoRA."""
    monkeypatch.setenv("MINDSPEED_CACHE", str(tmp_path / "cache"))
    lora, qlora = _run(tmp_path, "lora", "none"), _run(tmp_path, "qlora", "nf4")
    assert len(lora) == len(qlora) == 50 and lora[-1] < lora[0] - 0.1
    last = sum(lora[-5:]) / 5
    assert abs(sum(qlora[-5:]) / 5 - last) / last < 0.02, (lora[-5:], qlora[-5:])
