"""`mindspeed convert` of a tied-embedding model whose vocabulary (777) tp=2 does not divide:
`--tp 2` accepts it, the converted checkpoint loads under tp=2 (padded to 1024 rows) with
transformers' logits, and saved again under tp=2 it converts back to the original Hugging
Face tensors, 777 rows, no padding."""

from pathlib import Path

import pytest
import torch

from mindspeed_core.testing import import_sibling, run_distributed
from mindspeed_llm.models import checkpoint_io, hf_io
from mindspeed_tools.convert import hf_to_mindspeed, mindspeed_to_hf

LLM_TESTS = Path(__file__).resolve().parents[2] / "mindspeed-llm" / "tests"
models_hf = import_sibling(str(LLM_TESTS / "conftest.py"), "models_hf")
pytestmark = pytest.mark.distributed
VOCAB = 777


def _tp2_load_and_resave(converted: str, resaved: str, loss_parallel: bool):
    """The converted checkpoint under tp=2: its logits, rows, and a tp=2 save of it."""
    from mindspeed_core.checkpoint import CheckpointManager, ModelState, steps
    from mindspeed_core.parallel import ParallelDims, loss_parallel_context
    from mindspeed_llm.models import get_model_spec

    folder = Path(converted)
    config = checkpoint_io.read_checkpoint_config(folder)
    spec = get_model_spec(config.family)
    torch.manual_seed(123)  # other weights than the checkpoint's, so the load must work
    dims = ParallelDims(tp=2).build()
    model = spec.parallelize(spec.build(config), dims, loss_parallel=loss_parallel)
    checkpoint_io.load_model_weights(model, steps.resolve(folder))
    CheckpointManager({"model": ModelState(model)}, resaved).save(0, force=True)
    with torch.no_grad(), loss_parallel_context(loss_parallel):
        logits = model(models_hf.tokens())
        logits = logits.full_tensor() if loss_parallel else logits
    weight = model.tok_embeddings.weight.full_tensor()
    return {
        "logits": logits[..., :VOCAB],
        "padding_wins": bool((logits.argmax(-1) >= VOCAB).any()),
        "rows": weight.shape[0],
        "padding": weight[VOCAB:].abs().max().item(),
        "tied": model.output.weight is model.tok_embeddings.weight,
    }


@pytest.mark.parametrize(
    ("case", "loss_parallel"),
    [("llama", False), pytest.param("qwen2", True, marks=pytest.mark.slow)],
)
def test_an_odd_tied_vocabulary_converts_for_tp2_and_back_without_padding(
    tmp_path, case, loss_parallel
):
    hf = models_hf.make_hf(case, vocab_size=VOCAB, tie_word_embeddings=True)
    src = tmp_path / "hf"
    hf.save_pretrained(src)
    ours = hf_to_mindspeed(src, tmp_path / "ours", tp=2)  # refused before padding
    resaved = tmp_path / "resaved"
    with torch.no_grad():
        want = hf(models_hf.tokens()).logits
    for got in run_distributed(_tp2_load_and_resave, 2, str(ours), str(resaved), loss_parallel):
        assert (got["rows"], got["padding"], got["tied"]) == (1024, 0.0, True)
        assert not got["padding_wins"]
        torch.testing.assert_close(got["logits"], want, atol=1e-5, rtol=0)
    for name in (checkpoint_io.MANIFEST_FILE, "config.json"):
        (resaved / name).write_text((ours / name).read_text())
    back = mindspeed_to_hf(resaved, tmp_path / "back")
    expected, got = dict(hf_io.iter_hf_tensors(src)), dict(hf_io.iter_hf_tensors(back))
    assert got.keys() == expected.keys()
    assert got["model.embed_tokens.weight"].shape[0] == VOCAB
    for name, tensor in got.items():
        assert torch.equal(tensor, expected[name]), name
