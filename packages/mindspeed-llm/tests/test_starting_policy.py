"""`RunContext.starting_policy`: the one builder of the policy as the run started it.

- built again on the run's layout with the warm start (a state dict and/or a folder), it
  holds exactly the weights the policy was given; whole, the same in one module;
- a critic's trunk (`head=False`) keeps its own output layer;
- a frozen copy under pipeline parallel is refused in one line naming the layout.
"""

import dataclasses
import types
from pathlib import Path

import pytest
import torch

from mindspeed_core.errors import ConfigError
from mindspeed_core.parallel import ParallelConfig
from mindspeed_llm.models import build_model_config
from mindspeed_llm.train.build import build_model
from mindspeed_llm.train.objectives import RunContext
from mindspeed_llm.train.start import StartingWeights

SEQ = 16


def _run(start, pp: int = 1) -> RunContext:
    config = build_model_config("llama", flavor="debug", ops_impl="reference")
    parallel = ParallelConfig()
    dims = parallel.dims(1).build("cpu")
    cfg = types.SimpleNamespace(train=types.SimpleNamespace(seed=5),
                                model=types.SimpleNamespace(hf_path=None))  # fmt: skip

    def build(**options):
        return build_model(config, dims, torch.device("cpu"), **{
            "parallel": parallel, "seq_len": SEQ, "seed": 5, **options})  # fmt: skip

    if pp > 1:  # only the refusal reads the layout: a stand-in with pp stages
        dims = types.SimpleNamespace(pp=pp)
    return RunContext(cfg, dims, config, torch.device("cpu"), None, None, build, lambda s: None,
                      start=start)  # fmt: skip


def _warm_state() -> dict[str, torch.Tensor]:
    """A warm start unlike the seed's weights."""
    run = _run(None)
    model = run.build_model().model
    gen = torch.Generator().manual_seed(11)
    return {k: torch.randn(v.shape, generator=gen) for k, v in model.state_dict().items()}


def test_the_starting_policy_holds_the_warm_start_on_the_layout_and_whole():
    warm = _warm_state()
    run = _run(StartingWeights(state=warm))
    seed_only = run.build_model().model.state_dict()
    frozen = run.starting_policy()
    assert not any(p.requires_grad for p in frozen.model.parameters())
    whole = run.starting_policy(whole=True)
    assert not whole.training
    for name, value in warm.items():
        assert torch.equal(frozen.model.state_dict()[name], value), name
        assert torch.equal(whole.state_dict()[name], value), name
        assert not torch.equal(seed_only[name], value), name  # the test can fail
    # a critic's trunk: the warm body, its own (seed-drawn) output layer, trainable
    trunk = run.starting_policy(frozen=False, head=False)
    assert torch.equal(trunk.model.state_dict()["output.weight"], seed_only["output.weight"])
    assert torch.equal(trunk.model.state_dict()["norm.weight"], warm["norm.weight"])
    assert all(p.requires_grad for p in trunk.model.parameters())


def test_a_warm_start_folder_that_does_not_fit_names_its_field(tmp_path: Path):
    run = _run(StartingWeights(path=tmp_path / "nowhere", key="grpo.init_from"))
    with pytest.raises(ConfigError, match="nowhere"):
        run.starting_policy()


def test_a_frozen_copy_under_pipeline_parallel_is_one_line():
    run = _run(None, pp=2)
    with pytest.raises(ConfigError) as err:
        run.starting_policy()
    assert "parallel.pp=2" in str(err.value) and "\n" not in str(err.value)
    assert dataclasses.is_dataclass(run)
