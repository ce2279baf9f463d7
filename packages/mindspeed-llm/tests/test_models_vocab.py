"""Any vocabulary and tied embeddings under tensor parallel (fp32, 2 gloo ranks, one spawn):
a vocabulary of 777 padded to 1024 rows (Megatron's rule, vocab_divisible_by x tp) gives one
process's loss, logits and gradients, with and without tied embeddings, sequence parallel
and loss parallel; the padding never wins and gets no gradient; a checkpoint saved under
tp=2 holds 777 rows and loads into one process."""

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from mindspeed_core.checkpoint import ModelState
from mindspeed_core.parallel import ParallelDims, loss_parallel_context
from mindspeed_core.testing import run_distributed
from mindspeed_llm.models import build_model_config, get_model_spec
from mindspeed_llm.models.checkpoint_io import MODEL_KEY, load_model_weights

pytestmark = pytest.mark.distributed
VOCAB = 777
CASES = {
    "untied_sp": (False, {"sequence_parallel": True}),
    "tied_loss_parallel": (True, {"sequence_parallel": True, "loss_parallel": True}),
}


def _config(tied: bool):
    return build_model_config("llama", flavor="debug", vocab_size=VOCAB, tie_word_embeddings=tied)


def _batch():
    gen = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (2, 16), generator=gen), torch.randint(
        0, VOCAB, (2, 16), generator=gen
    )


def _full(t):
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _step(tied: bool, options: dict | None = None, save_to=None):
    """Loss, logits, gradients and parameters after one SGD step; no options: one process."""
    spec = get_model_spec("llama")
    torch.manual_seed(0)
    model = spec.build(_config(tied))
    if options is not None:
        model = spec.parallelize(model, ParallelDims(tp=2).build(), **options)
    tokens, labels = _batch()
    with loss_parallel_context((options or {}).get("loss_parallel", False)):
        logits = model(tokens)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        loss.backward()
    out = {
        "rows": model.tok_embeddings.weight.shape[0],
        "tied": model.output.weight is model.tok_embeddings.weight,
        "loss": _full(loss),
        "logits": _full(logits),
        "grads": {n: _full(p.grad) for n, p in model.named_parameters()},
    }
    torch.optim.SGD(model.parameters(), lr=0.5).step()
    out["params"] = {n: _full(p) for n, p in model.named_parameters()}
    if save_to is not None:
        dcp.save({MODEL_KEY: ModelState(model)}, checkpoint_id=save_to)
        dist.barrier()
    return out


def _tp2(folder):
    return {
        name: _step(tied, options, save_to=f"{folder}/{name}")
        for name, (tied, options) in CASES.items()
    }


def test_a_padded_vocabulary_and_tied_embeddings_under_tp_equal_one_process(tmp_path):
    results = run_distributed(_tp2, 2, str(tmp_path))[0]
    for name, (tied, _) in CASES.items():
        got, want = results[name], _step(tied)
        assert (got["rows"], want["rows"]) == (1024, VOCAB) and got["tied"] == tied
        if name == "tied_loss_parallel":  # vocab-sharded logits: padding masked, never wins
            assert got["logits"].shape[-1] == 1024
            assert got["logits"].argmax(-1).max() < VOCAB
            got["logits"] = got["logits"][..., :VOCAB]
        torch.testing.assert_close(got["loss"], want["loss"], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got["logits"], want["logits"], atol=1e-5, rtol=1e-5)
        for n, grad in want["grads"].items():
            torch.testing.assert_close(got["grads"][n][: grad.shape[0]], grad, atol=1e-5, rtol=0)
            assert not got["grads"][n][grad.shape[0] :].any(), f"{n}: padding got a gradient"
        # the checkpoint saved under tp=2 holds 777 rows and loads into one process
        model = get_model_spec("llama").build(_config(tied))
        load_model_weights(model, tmp_path / name)
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.detach(), want["params"][n], atol=1e-5, rtol=0)
            torch.testing.assert_close(p.detach(), got["params"][n][: p.shape[0]], atol=0, rtol=0)
