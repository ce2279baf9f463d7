"""`mindspeed_llm.loading`: one folder resolved once into a `ModelSource` (a Hugging Face folder or
a trainer run's checkpoints), and `load_model` reading it into our model."""

import pytest
import torch

from mindspeed_core.checkpoint import CheckpointManager, ModelState
from mindspeed_core.errors import CheckpointError, ConfigError
from mindspeed_core.testing import import_sibling
from mindspeed_llm.loading import checkpoint_source, load_model, resolve_model_source
from mindspeed_llm.models import build_model_config, get_model_spec

models_hf = import_sibling(__file__, "models_hf")


def test_a_hugging_face_folder(tmp_path):
    models_hf.make_hf("qwen2").save_pretrained(tmp_path)
    source = resolve_model_source(tmp_path, ops_impl="reference")
    assert (source.kind, source.weights, source.tokenizer, source.hf_dir) == (
        "hf",
        tmp_path,
        tmp_path,
        tmp_path,
    )
    assert source.config.family == "qwen2" and source.config.ops_impl == "reference"
    with pytest.raises(CheckpointError, match="is not a MindSpeed checkpoint"):
        checkpoint_source(tmp_path)


def _run(tmp_path):
    """A trainer run's folder: checkpoints/step_3 + latest, and config.yaml naming the model
    and the tokenizer its data used."""
    run = tmp_path / "run"
    config = build_model_config("llama", flavor="debug")
    torch.manual_seed(0)
    model = get_model_spec("llama").build(config)
    CheckpointManager({"model": ModelState(model)}, run / "checkpoints").save(3, force=True)
    tokenizer = tmp_path / "tok" / "tokenizer.model"
    tokenizer.parent.mkdir()
    tokenizer.write_bytes(b"")  # only its path matters here
    (run / "config.yaml").write_text(
        f"model:\n  family: llama\n  flavor: debug\ndata:\n  tokenizer: {tokenizer}\n"
    )
    return run, model.eval(), tokenizer


def test_a_run_checkpoint_folder_or_one_step_of_it(tmp_path):
    run, model, tokenizer = _run(tmp_path)
    for folder in (run / "checkpoints", run / "checkpoints" / "step_3"):
        source = resolve_model_source(folder)
        assert (source.kind, source.weights) == ("run", run / "checkpoints" / "step_3")
        assert (source.tokenizer, source.hf_dir) == (tokenizer, None)
        assert source.config == build_model_config("llama", flavor="debug")
    loaded, config = load_model(source)
    assert not loaded.training and config == source.config
    ids = torch.randint(0, config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids), model(ids), atol=0, rtol=0)
    (run / "config.yaml").unlink()
    with pytest.raises(ConfigError, match="cannot tell which model it holds"):
        resolve_model_source(run / "checkpoints")
