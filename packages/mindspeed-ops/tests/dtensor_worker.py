"""One rank of test_dtensor.py: `python dtensor_worker.py RANK WORLD PORT`; exit 0 on success.

Runs rms_norm and swiglu on full tensors (the oracle) and on DTensors sharded along the
sequence, then compares the gathered outputs and gradients, including the replicated norm
weight, whose gradient must be summed across ranks.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

import mindspeed_ops as mo


def _inputs():
    gen = torch.Generator().manual_seed(0)
    return {
        "x": torch.randn(2, 6, 13, generator=gen),
        "w": torch.randn(13, generator=gen),
        "gate": torch.randn(2, 6, 2 * 7, generator=gen),
        "g_norm": torch.randn(2, 6, 13, generator=gen),
        "g_act": torch.randn(2, 6, 7, generator=gen),
    }


def _block(x, w, gate, g_norm, g_act):
    y = mo.rms_norm(x, w, offset=True, impl="cpu")
    z = mo.swiglu(gate, impl="cpu")
    z2 = mo.swiglu(gate[..., :7], gate[..., 7:], impl="cpu")
    return (y * g_norm).sum() + (z * g_act).sum() + (z2 * g_act).sum(), y, z


def _expected():
    full = {k: v.requires_grad_(k in ("x", "w", "gate")) for k, v in _inputs().items()}
    loss, y, z = _block(**full)
    loss.backward()
    return {"loss": loss, "y": y, "z": z, "dx": full["x"].grad, "dw": full["w"].grad,
            "dgate": full["gate"].grad}  # fmt: skip


def main(rank: int, world: int, port: int) -> None:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        full, seq = _inputs(), [Shard(1)]
        x = distribute_tensor(full["x"], mesh, seq).requires_grad_()
        w = distribute_tensor(full["w"], mesh, [Replicate()]).requires_grad_()
        gate = distribute_tensor(full["gate"], mesh, seq).requires_grad_()
        loss, y, z = _block(x, w, gate, *(distribute_tensor(full[k], mesh, seq)
                                          for k in ("g_norm", "g_act")))  # fmt: skip
        assert y.placements == (Shard(1),) and z.placements == (Shard(1),), (y, z)
        loss.backward()
        got = {"loss": loss, "y": y, "z": z, "dx": x.grad, "dw": w.grad, "dgate": gate.grad}
        for name, want in _expected().items():
            torch.testing.assert_close(
                got[name].full_tensor(), want.detach(), atol=1e-5, rtol=1e-5,
                msg=lambda m, name=name: f"{name}: {m}",
            )  # fmt: skip
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(*map(int, sys.argv[1:4]))
