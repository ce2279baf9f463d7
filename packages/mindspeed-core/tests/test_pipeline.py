"""Pipeline splits: which layers each stage gets, which stages each rank holds, the names
the stage modules keep (so checkpoints are layout-free), and the errors for bad layouts.

The numbers of pipelined training against one process are tested with the real decoder
in mindspeed-llm (tests/test_models_pipeline.py)."""

import pytest
import torch
from torch import nn

from mindspeed_core.errors import ParallelError
from mindspeed_core.optim import clip_grad_norm_
from mindspeed_core.parallel import (
    ParallelDims,
    check_pipeline,
    split_model,
    stage_ids_this_rank,
    stage_layer_counts,
)
from mindspeed_core.testing import run_distributed


class Tiny(nn.Module):
    """Embedding -> ModuleDict of blocks -> norm -> output, torchtitan's names."""

    def __init__(self, num_layers: int = 4, dim: int = 8, vocab: int = 16):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleDict({str(i): nn.Linear(dim, dim) for i in range(num_layers)})
        self.norm = nn.LayerNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, x):
        h = x if self.tok_embeddings is None else self.tok_embeddings(x)
        for layer in self.layers.values():
            h = torch.relu(layer(h))
        if self.norm is not None:
            h = self.norm(h)
        return h if self.output is None else self.output(h)


@pytest.mark.parametrize(
    ("num_layers", "num_stages", "given", "expected"),
    [
        (4, 2, None, [2, 2]),
        (4, 4, None, [1, 1, 1, 1]),
        (5, 4, None, [2, 1, 1, 1]),  # no-op padding: one no-op at the end of stages 1-3
        (7, 3, None, [3, 2, 2]),
        (4, 2, [3, 1], [3, 1]),
        (4, 3, [0, 3, 1], [0, 3, 1]),  # the first stage may hold only the embedding
        (4, 3, [2, 2, 0], [2, 2, 0]),  # the last only the head
    ],
)
def test_layer_counts(num_layers, num_stages, given, expected):
    assert stage_layer_counts(num_layers, num_stages, given) == expected


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_layers": 2, "pp": 4}, "4 pipeline stages .* only 2 layers"),
        ({"num_layers": 4, "pp": 2, "stages_per_rank": 3}, "one stage per rank"),
        ({"num_layers": 4, "pp": 2, "layers_per_stage": [2, 1, 1]}, "has 3 entries"),
        ({"num_layers": 4, "pp": 2, "layers_per_stage": [3, 2]}, "sum to the model's 4"),
        ({"num_layers": 4, "pp": 3, "layers_per_stage": [2, 0, 2]}, "stage 1 would hold"),
        ({"num_layers": 4, "pp": 2, "schedule": "Nope"}, "schedule 'Nope'"),
        (
            {"num_layers": 8, "pp": 2, "schedule": "ZBVZeroBubble", "stages_per_rank": 3},
            "exactly 2 virtual stages",
        ),
        ({"num_layers": 4, "pp": 2, "n_microbatches": 1}, "at least as many microbatches"),
        (
            {
                "num_layers": 8,
                "pp": 2,
                "schedule": "DualPipeV",
                "stages_per_rank": 2,
                "recompute": True,
            },
            "activation checkpointing breaks",
        ),
        (
            {
                "num_layers": 8,
                "pp": 2,
                "schedule": "Interleaved1F1B",
                "stages_per_rank": 2,
                "n_microbatches": 5,
            },
            "multiple of 2",
        ),
    ],
)
def test_bad_layouts_are_named(kwargs, message):
    with pytest.raises(ParallelError, match=message):
        check_pipeline(**kwargs)


def test_stage_ids_loop_and_v():
    assert [stage_ids_this_rank(r, 2, 1, "1F1B") for r in range(2)] == [[0], [1]]
    assert [stage_ids_this_rank(r, 2, 2, "Interleaved1F1B") for r in range(2)] == [
        [0, 2],
        [1, 3],
    ]
    assert [stage_ids_this_rank(r, 2, 2, "ZBVZeroBubble") for r in range(2)] == [[0, 3], [1, 2]]


def test_stage_modules_keep_their_names_and_chain_to_the_whole():
    torch.manual_seed(0)
    model = Tiny()
    counts = [1, 2, 0, 1]
    parts = split_model(model, range(4), counts)
    names = [sorted(n for n, _ in p.named_parameters()) for p in parts]
    assert names[0] == ["layers.0.bias", "layers.0.weight", "tok_embeddings.weight"]
    assert names[1] == [f"layers.{i}.{k}" for i in (1, 2) for k in ("bias", "weight")]
    assert names[2] == []
    assert names[3] == [
        "layers.3.bias",
        "layers.3.weight",
        "norm.bias",
        "norm.weight",
        "output.weight",
    ]
    merged = {}
    for part in parts:
        merged.update(part.state_dict())
    assert merged.keys() == model.state_dict().keys()
    tokens = torch.randint(0, 16, (2, 5))
    h = tokens
    for part in parts:
        h = part(h)
    torch.testing.assert_close(h, model(tokens), rtol=0, atol=0)
    # the model itself is untouched, and the parts are copies
    assert len(model.layers) == 4 and model.norm is not None
    assert parts[0].layers["0"].weight is not model.layers["0"].weight


def test_tied_parts_on_different_stages_are_refused():
    model = Tiny()
    model.output.weight = model.tok_embeddings.weight
    with pytest.raises(ParallelError, match="tied embeddings"):
        split_model(model, [0], [2, 2])
    # tied=True: the first and the last stage each get their own, equal copy
    first, last = split_model(model, [0, 1], [2, 2], tied=True)
    assert first.output is None and last.tok_embeddings is None
    assert last.output.weight is not model.tok_embeddings.weight
    assert torch.equal(last.output.weight, first.tok_embeddings.weight)


def _clip_over_stages():
    """Each pp rank holds half the gradients; one holds none at all for a second case."""
    dims = ParallelDims(pp=2).build()
    rank = dims.rank("pp")
    param = nn.Parameter(torch.zeros(4))
    param.grad = torch.full((4,), 3.0 if rank == 0 else 4.0)
    norm = clip_grad_norm_([param], max_norm=1.0, pp_mesh=dims.mesh("pp"))
    lonely = nn.Parameter(torch.zeros(4))
    lonely.grad = torch.full((4,), 2.0) if rank == 0 else None
    norm_one_sided = clip_grad_norm_([lonely], max_norm=0.0, pp_mesh=dims.mesh("pp"))
    return norm, param.grad, norm_one_sided


@pytest.mark.distributed
def test_clip_grad_norm_reduces_over_pipeline_stages():
    results = run_distributed(_clip_over_stages, 2, timeout=120)
    whole = torch.tensor([3.0] * 4 + [4.0] * 4).norm()  # 10
    for rank, (norm, grad, one_sided) in enumerate(results):
        torch.testing.assert_close(norm, whole)
        torch.testing.assert_close(grad, torch.full((4,), (3.0, 4.0)[rank] / 10), atol=1e-6, rtol=0)
        torch.testing.assert_close(one_sided, torch.tensor(4.0))
