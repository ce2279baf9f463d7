"""A DPO step that does not log reads no device value on the host (no sync): the policy's
log-probs from the replies' positions only, the frozen reference's in the targets, bf16
autocast, fused AdamW; counted by `mindspeed_core.testing.HostSyncs`. Pretraining's and SFT's:
packages/mindspeed-llm/tests/test_train_syncs.py."""

import math
from pathlib import Path

import pytest

from mindspeed_align.dpo import PreferenceObjective
from mindspeed_align.dpo_config import DPOConfig
from mindspeed_align.pairs import PairData
from mindspeed_core.config import load_config
from mindspeed_core.distributed import destroy_distributed, init_distributed
from mindspeed_core.testing import import_sibling
from mindspeed_llm.train.trainer import Trainer

dpo_tests = import_sibling(__file__, "test_dpo")
llm_syncs = import_sibling(str(Path(__file__).resolve().parents[2] / "mindspeed-llm" / "tests" / "x.py"),
                           "test_train_syncs")  # fmt: skip


@pytest.mark.parametrize("ref", ["model", "precompute"])
def test_a_dpo_step_reads_nothing_on_the_host(tmp_path, ref):
    folder, data = dpo_tests.make_inputs(tmp_path, n=16)
    args = dpo_tests.run_args(folder, data, tmp_path / "run", "--train.steps=4",
                              "--train.micro_batch=2", "--train.global_batch=4", f"--dpo.ref={ref}",
                              f"--data.cache_dir={tmp_path / 'cache'}", *llm_syncs.COMMON)  # fmt: skip
    args = [a for a in args if a != "--model.ops_impl=reference" and "log_interval=1" not in a]
    cfg = load_config(DPOConfig, None, args)
    try:
        objective = PreferenceObjective(cfg.dpo)
        trainer = Trainer(cfg, init_distributed(device_type="cpu"), data=PairData,
                          objective=objective, command="dpo")  # fmt: skip
        assert trainer.step._supervised_only
        assert (objective.reference is not None) == (ref == "model")
        syncs, result = llm_syncs.count_syncs(trainer)
    finally:
        destroy_distributed()
    assert not syncs.reads, syncs.report()
    assert math.isfinite(result.loss) and "rewards/margins" in result.metrics
