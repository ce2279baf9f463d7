import pytest
import torch
import torch.distributed as dist

from mindspeed_core.distributed import (
    destroy_distributed,
    elastic_restart_warning,
    get_rank,
    get_world_size,
    init_distributed,
    read_launch_env,
)
from mindspeed_core.errors import ParallelError

GOOD = {
    "RANK": "1",
    "WORLD_SIZE": "4",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29500",
}


def test_restarts_through_the_agents_store_are_warned_about():
    """torchrun exports these to every worker (local_elastic_agent.py): a restart of a job
    whose workers share the agent's store may fail (pytorch/pytorch#135712)."""
    shared = {**GOOD, "TORCHELASTIC_MAX_RESTARTS": "3", "TORCHELASTIC_USE_AGENT_STORE": "True"}
    warning = elastic_restart_warning(shared)
    assert warning and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in warning
    own_store = {**shared, "TORCHELASTIC_USE_AGENT_STORE": "False"}  # the variable was set
    assert elastic_restart_warning(own_store) is None
    assert elastic_restart_warning({**shared, "TORCHELASTIC_MAX_RESTARTS": "0"}) is None
    assert elastic_restart_warning(GOOD) is None  # not under torchrun's agent


def test_reads_torchrun_environment():
    env = read_launch_env(GOOD)
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (1, 4, 1, 2)
    assert (env.master_addr, env.master_port) == ("127.0.0.1", 29500)
    single = read_launch_env({})
    assert (single.rank, single.world_size, single.local_rank) == (0, 1, 0)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"RANK": None}, r"RANK is not set but WORLD_SIZE is"),
        ({"WORLD_SIZE": None}, r"WORLD_SIZE is not set but RANK is"),
        ({"RANK": "x"}, r"RANK='x' is not an integer"),
        ({"RANK": "4"}, r"RANK=4 is outside \[0, WORLD_SIZE=4\)"),
        ({"WORLD_SIZE": "0", "RANK": "0"}, r"WORLD_SIZE=0 must be at least 1"),
        ({"LOCAL_RANK": None}, r"LOCAL_RANK is not set"),
        (
            {"LOCAL_RANK": "2"},
            r"LOCAL_RANK=2 with LOCAL_WORLD_SIZE=2 and WORLD_SIZE=4 is inconsistent",
        ),
        ({"MASTER_ADDR": None}, r"MASTER_ADDR is not set but WORLD_SIZE=4"),
        ({"MASTER_PORT": None}, r"MASTER_PORT is not set but WORLD_SIZE=4"),
        ({"MASTER_PORT": "70000"}, r"MASTER_PORT=70000 is not a valid port"),
    ],
)
def test_inconsistent_environment_is_a_clear_error(change, message):
    env = {k: v for k, v in {**GOOD, **change}.items() if v is not None}
    with pytest.raises(ParallelError, match=message):
        read_launch_env(env)


def test_single_process_needs_no_environment(monkeypatch):
    for var in (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
    ):
        monkeypatch.delenv(var, raising=False)
    info = init_distributed(device_type="cpu", timeout=30)
    try:
        assert (info.rank, info.world_size, info.backend, info.is_rank0) == (0, 1, "gloo", True)
        assert get_rank() == 0 and get_world_size() == 1
        x = torch.ones(3)
        dist.all_reduce(x)
        assert torch.equal(x, torch.ones(3))
        with pytest.raises(ParallelError, match="already initialised"):
            init_distributed(device_type="cpu")
    finally:
        destroy_distributed()
    assert not dist.is_initialized()
