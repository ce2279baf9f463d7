"""LoRA RL (`--lora.rank` with grpo/ppo): only the adapters train, the reference is the
policy with its adapters off (the base's log-probs), the rollout's copy gets the base once
and the adapters every step, and the losses equal a hand computation on hand-merged weights
(W + alpha/r B A written out here). The CLI runs (exact resume, the peft export as an
oracle, bad inputs) are in `test_rl_lora_cli.py`."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from mindspeed_align.rl.config import GRPOConfig, GRPOSection
from mindspeed_align.rl.grpo import GRPOStep
from mindspeed_align.rl.lora import BaseReference, merged_policy
from mindspeed_align.rl.objective import GRPOObjective
from mindspeed_align.rl.rollout import LocalRollout, RolloutBatch
from mindspeed_core.optim import OptimConfig
from mindspeed_core.parallel import ParallelConfig
from mindspeed_core.testing import import_sibling
from mindspeed_llm.models import build_model_config
from mindspeed_llm.peft import LoRAConfig, lora_transform
from mindspeed_llm.train.build import build_model, build_train_parts

RANK, ALPHA, KL_COEF = 8, 16.0, 0.1
# two prompts, two samples each; rewards 1/0 per group: advantages +-1/sqrt(2) (grpo, n=2)
PROMPTS = [[5, 9, 14], [5, 9, 14], [7, 3, 22, 8], [7, 3, 22, 8]]
RESPONSES = [[31, 40, 2], [12, 6], [44, 45, 46, 47], [19, 3]]
REWARDS = [1.0, 0.0, 0.0, 1.0]


class _FixedRollout:
    """Stands in for the sampler: the same samples every step."""

    def sync_weights(self) -> float:
        return 0.0

    def generate(self, prompts, sampling, seed):
        return RolloutBatch(
            prompt_ids=PROMPTS, response_ids=RESPONSES,
            sampler_logprobs=[[-1.0] * len(r) for r in RESPONSES], group=[0, 0, 1, 1],
            stopped=[True] * len(RESPONSES),
        )  # fmt: skip


class _FixedRewards:
    def __call__(self, prompts, completions, columns):
        return list(REWARDS), {"reward/failures": 0.0}


class _Tokenizer:
    eod_id = None

    def decode(self, ids) -> str:
        return " ".join(map(str, ids))


def _config():
    return build_model_config("llama", flavor="debug", ops_impl="reference")


def _policy(lora: LoRAConfig | None):
    dims = ParallelConfig().dims(1).build("cpu")
    hook = None if lora is None else lora_transform(lora)
    policy = build_model(_config(), dims, torch.device("cpu"), parallel=ParallelConfig(),
                         seq_len=32, seed=1234, after_tp=hook)  # fmt: skip
    return policy, dims


def _step():
    lora = LoRAConfig(rank=RANK, alpha=ALPHA)
    policy, dims = _policy(lora)
    optim = OptimConfig(lr=2e-2, warmup_steps=0, weight_decay=0.0)
    parts = build_train_parts(policy, optim, total_steps=10, adapter_only=True)
    rl = GRPOSection(n=2, max_new_tokens=4, reward_workers=0, kl_coef=KL_COEF, kl_estimator="k3")
    cfg = dataclasses.replace(GRPOConfig(), grpo=rl, lora=lora)
    step = GRPOStep(parts, GRPOObjective.from_section(rl), dims, cfg=cfg, tokenizer=_Tokenizer(),
                    rewards=_FixedRewards(), reference=BaseReference(policy), clip_grad=0.0)  # fmt: skip
    step.rollout = _FixedRollout()
    records = [{"prompt": "a", "prompt_ids": PROMPTS[0]}, {"prompt": "b", "prompt_ids": PROMPTS[2]}]
    return step, policy, records


def _hand_merged(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The base's names with W + (alpha / r) B A, written out here."""
    out = {k: v.clone() for k, v in state.items() if ".lora_" not in k}
    for key, a in state.items():
        if key.endswith(".lora_A.weight"):
            module = key.removesuffix(".lora_A.weight")
            b = state[f"{module}.lora_B.weight"]
            out[f"{module}.weight"] += (ALPHA / RANK) * (b @ a)
    return out


def _logps(state: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """Each sample's response-token log-probs, from a plain model holding `state`."""
    model, _ = _policy(None)
    model.model.load_state_dict(state)
    out = []
    with torch.no_grad():
        for p, r in zip(PROMPTS, RESPONSES, strict=True):
            logits = model.model(torch.tensor([p + r])).float()[0, len(p) - 1 : -1]
            out.append(torch.log_softmax(logits, -1).gather(-1, torch.tensor(r)[:, None])[:, 0])
    return out


def _hand_loss(policy_logps, ref_logps) -> float:
    """One on-policy update's token-mean loss (ratio 1: -A per token) + kl_coef x k3."""
    adv = [1 / math.sqrt(2) if r else -1 / math.sqrt(2) for r in REWARDS]
    per_token = []
    for lp, ref, a in zip(policy_logps, ref_logps, adv, strict=True):
        log_r = ref.double() - lp.double()
        per_token.append(-a + KL_COEF * (torch.exp(log_r) - log_r - 1))
    return torch.cat(per_token).mean().item()


def test_grpo_with_lora_trains_adapters_only_against_the_base_as_reference():
    step, policy, records = _step()
    model = policy.model
    base = {k: v.detach().clone() for k, v in model.state_dict().items() if ".lora_" not in k}
    base_logps = _logps(base)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_" in n for n in trainable)
    assert len(trainable) == 7 * 2 * 2  # q k v o gate up down x A, B x 2 layers
    first = step(records)
    # B starts at 0: the policy is its base, the KL 0; the loss is the surrogate's -A mean
    assert first.metrics["kl"] == 0.0
    assert first.loss == pytest.approx(_hand_loss(base_logps, base_logps), abs=1e-6)
    after_one = {k: v.detach().clone() for k, v in model.state_dict().items()}
    second = step(records)
    # the policy is base + adapters (hand-merged); the reference still the base's log-probs
    merged_logps = _logps(_hand_merged(after_one))
    assert second.loss == pytest.approx(_hand_loss(merged_logps, base_logps), abs=1e-6)
    assert second.metrics["kl"] > 1e-6
    ref = step.reference.submit(
        step._pack(_FixedRollout().generate(None, None, 0), {}, [0, 1, 2, 3]), 1.0
    )()
    mask = torch.cat([torch.tensor(r, dtype=torch.float) for r in RESPONSES])  # response tokens
    got = torch.cat([t.flatten() for t in ref])
    want = torch.cat(base_logps)
    assert got[got != 0].numel() == mask.numel()
    torch.testing.assert_close(got[got != 0], want, atol=1e-5, rtol=1e-5)
    # the base did not move, bit for bit; every adapter did (A from the first step's grads on B)
    now = model.state_dict()
    assert all(torch.equal(now[k], v) for k, v in base.items())
    moved = [k for k in now if ".lora_B" in k and not torch.equal(now[k], torch.zeros_like(now[k]))]
    assert len(moved) == 7 * 2


def test_the_rollout_copy_gets_the_base_once_then_the_adapters_alone():
    lora = LoRAConfig(rank=RANK, alpha=ALPHA)
    policy, _ = _policy(lora)
    with torch.no_grad():  # adapters that change the outputs
        for name, p in policy.model.named_parameters():
            if ".lora_B" in name:
                p.normal_(0, 0.05)
    rollout = LocalRollout(policy, copy=True, lora=lora)
    state = policy.model.state_dict()
    total = sum(v.numel() * v.element_size() for v in state.values())
    adapters = sum(v.numel() * v.element_size() for k, v in state.items() if ".lora_" in k)
    rollout.sync_weights()
    assert rollout.last_bytes == total
    rollout.sync_weights()
    assert rollout.last_bytes == adapters and adapters < total / 5
    ids = torch.tensor([PROMPTS[2] + RESPONSES[2]])
    with torch.no_grad():
        torch.testing.assert_close(rollout.module(ids), policy.model(ids), atol=1e-6, rtol=1e-6)
        # vLLM's view: one plain model with the merged weights gives the same logits
        merged = merged_policy(policy, lora).model.state_dict()
        assert not any(".lora_" in k for k in merged)
        torch.testing.assert_close(merged, _hand_merged(dict(state)), atol=1e-6, rtol=1e-6)
        plain, _ = _policy(None)
        plain.model.load_state_dict(merged)
        torch.testing.assert_close(plain.model(ids), policy.model(ids), atol=1e-5, rtol=1e-5)


fake_vllm = import_sibling(__file__, "test_rl_vllm").fake_vllm  # the stand-in engine


def test_vllm_gets_the_merged_weights_under_hugging_face_names(fake_vllm):
    """The engine (the stand-in `vllm` of `test_rl_vllm.py`) is sent W + (alpha / r) B A,
    written out here, under Hugging Face's names, with no adapter tensor."""
    from safetensors.torch import load_file

    from mindspeed_align.rl.vllm_rollout import VLLMRollout

    python, _ = fake_vllm
    lora = LoRAConfig(rank=RANK, alpha=ALPHA)
    dims = ParallelConfig().dims(1).build("cpu")
    policy = build_model(build_model_config("llama", "debug-h32"), dims, torch.device("cpu"),
                         parallel=ParallelConfig(), seq_len=64, seed=3, after_tp=lora_transform(lora))  # fmt: skip
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if ".lora_B" in name:
                p.normal_(0, 0.05)
    rollout = VLLMRollout(merged_policy(policy, lora), python, max_model_len=64)
    try:
        rollout.sync_weights()
        sent = load_file(str(rollout.weights_dir / "model.safetensors"))
    finally:
        rollout.close()
    assert not any("lora" in k for k in sent)
    wq = policy.model.layers["0"].attention.wq
    want = wq.weight + (ALPHA / RANK) * wq.lora_B.weight @ wq.lora_A.weight
    torch.testing.assert_close(sent["model.layers.0.self_attn.q_proj.weight"], want.detach())
    assert not torch.allclose(want, wq.weight)


PROMPTS_2 = [[5, 17, 33, 9], [101, 7]]


def _sharded_lora(layout: str):
    """Rank's view of a LoRA policy sharded by FSDP (dp_shard=2) or tensor parallel (tp=2):
    its rollout copy's sync
    bytes, how far the copy's samples' log-probs are from the policy's, and how far the
    adapters-off reference is from a base built without adapters (and from the policy)."""
    import torch.distributed as dist

    from mindspeed_align.rl.objective import pack_samples, recompute_logps
    from mindspeed_align.rl.rollout import SamplingConfig

    lora, parallel = LoRAConfig(rank=RANK, alpha=ALPHA), ParallelConfig(**{layout: 2})
    dims = parallel.dims().build("cpu")
    build = {"parallel": parallel, "seq_len": 32, "seed": 1234}
    policy = build_model(
        _config(), dims, torch.device("cpu"), after_tp=lora_transform(lora), **build
    )
    base = build_model(_config(), dims, torch.device("cpu"), **build)
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if ".lora_B" in name:
                p.add_(0.05)
    rollout = LocalRollout(policy, lora=lora)
    rollout.sync_weights()
    sizes = [rollout.last_bytes]
    rollout.sync_weights()
    sizes.append(rollout.last_bytes)
    batch = rollout.generate(
        PROMPTS_2,
        SamplingConfig(n=2, max_new_tokens=4),
        seed=dist.get_rank() if layout == "dp_shard" else 0,
    )
    packed = pack_samples(batch.prompt_ids, batch.response_ids, {}, {}, agg="token-mean",
                          max_new_tokens=8)  # fmt: skip
    mask = packed["labels"][0] != -100
    logps = recompute_logps(policy, packed, 1.0)[0][mask]
    sampler = torch.tensor([lp for row in batch.sampler_logprobs for lp in row])
    ref = BaseReference(policy).submit([packed], 1.0)()[0][0][mask]
    plain = recompute_logps(base, packed, 1.0)[0][mask]
    return sizes, (logps - sampler).abs().max().item(), (ref - plain).abs().max().item(), (
        (ref - logps).abs().max().item())  # fmt: skip


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("layout", ["dp_shard", "tp"])
def test_a_sharded_lora_policy_rolls_out_through_a_copy_with_its_adapters(layout):
    from mindspeed_core.testing import run_distributed

    state = _policy(LoRAConfig(rank=RANK, alpha=ALPHA))[0].model.state_dict()
    whole = sum(v.numel() * 4 for v in state.values())
    adapters = sum(v.numel() * 4 for k, v in state.items() if ".lora_" in k)
    for sizes, sampled, ref_vs_base, ref_vs_policy in run_distributed(
        _sharded_lora, 2, layout, timeout=600
    ):
        assert sizes == [whole, adapters]
        assert sampled < 1e-5  # the copy samples the policy with its adapters
        assert ref_vs_base < 1e-5 < ref_vs_policy  # adapters off: the base's log-probs
