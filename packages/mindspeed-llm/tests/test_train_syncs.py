"""A training step that does not log reads no device value on the host (no sync): pretraining
and SFT (supervised positions only, bf16 autocast, fused AdamW), counted by
`mindspeed_core.testing.HostSyncs`; reading the result afterwards (a logging step) is where
the host waits, once. DPO's step: packages/mindspeed-align/tests/test_dpo.py."""

import math

import pytest

from mindspeed_core.config import load_config
from mindspeed_core.distributed import destroy_distributed, init_distributed
from mindspeed_core.testing import HostSyncs, import_sibling
from mindspeed_llm.train.config import PretrainConfig
from mindspeed_llm.train.objectives import NextToken
from mindspeed_llm.train.sft_config import SFTConfig
from mindspeed_llm.train.sft_data import SFTData
from mindspeed_llm.train.trainer import Trainer

sft_tests = import_sibling(__file__, "test_sft_train")

COMMON = ["--train.precision=bf16", "--optim.implementation=fused", "--optim.warmup_steps=1",
          "--train.eval_interval=0", "--logging.log_interval=100", "--logging.progress=false",
          "--logging.tensorboard=false"]  # fmt: skip


def count_syncs(trainer) -> tuple[HostSyncs, object]:
    """The syncs of the trainer's second step (the first warms up)."""
    trainer.step(trainer.data.next_step())
    batches = trainer.data.next_step()
    with HostSyncs(host=[t for b in batches for t in b.values()]) as syncs:
        result = trainer.step(batches)
    return syncs, result


@pytest.mark.parametrize("normalization", ["token", "sample"])
def test_a_pretraining_step_reads_nothing_on_the_host(tmp_path, monkeypatch, normalization):
    monkeypatch.setenv("MINDSPEED_CACHE", str(tmp_path / "cache"))
    cfg = load_config(PretrainConfig, None, [
        "--train.steps=4", "--train.micro_batch=2", "--train.global_batch=4", "--data.seq_len=64",
        f"--train.loss_normalization={normalization}", f"--logging.run_dir={tmp_path / 'run'}",
        *COMMON,
    ])  # fmt: skip
    try:
        trainer = Trainer(cfg, init_distributed(device_type="cpu"))
        syncs, result = count_syncs(trainer)
    finally:
        destroy_distributed()
    assert not syncs.reads, syncs.report()
    assert math.isfinite(result.loss) and result.num_tokens == 4 * 64  # read when logging


def test_an_sft_step_reads_nothing_on_the_host(tmp_path):
    folder, data = sft_tests.make_run_inputs(tmp_path, n=16)
    args = sft_tests.run_args(folder, data, tmp_path / "run", "--train.steps=4",
                              "--train.micro_batch=2", "--train.global_batch=4", *COMMON)  # fmt: skip
    args = [a for a in args if a != "--model.ops_impl=reference" and "log_interval=1" not in a]
    cfg = load_config(SFTConfig, None, args)
    try:
        objective = NextToken(supervised_logits_only=True)
        trainer = Trainer(cfg, init_distributed(device_type="cpu"), data=SFTData,
                          objective=objective, command="sft")  # fmt: skip
        assert trainer.step._supervised_only  # the logits of the replies' positions only
        syncs, result = count_syncs(trainer)
    finally:
        destroy_distributed()
    assert not syncs.reads, syncs.report()
    assert math.isfinite(result.loss) and result.grad_norm > 0
