"""rms_norm and swiglu on sequence-sharded DTensors: two gloo ranks against full tensors."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from mindspeed_ops.dtensor import run_rowwise

WORKER = Path(__file__).with_name("dtensor_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.distributed
@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not built")
def test_rowwise_ops_on_sequence_sharded_dtensors():
    port, env = _free_port(), dict(os.environ, OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen([sys.executable, str(WORKER), str(rank), "2", str(port)], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for rank in range(2)
    ]  # fmt: skip
    outputs = [p.communicate(timeout=240)[0] for p in procs]
    for rank, (proc, out) in enumerate(zip(procs, outputs, strict=True)):
        assert proc.returncode == 0, f"rank {rank} failed:\n{out[-3000:]}"


def test_sharding_the_hidden_dim_is_refused():
    class HiddenShard:
        dim = 2

        def is_shard(self):
            return True

    class FakeDTensor:
        ndim, placements = 3, (HiddenShard(),)

    with pytest.raises(ValueError, match="rms_norm: x must not be sharded on its last dim"):
        run_rowwise("rms_norm", lambda t: t, FakeDTensor())
