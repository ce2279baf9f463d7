"""Reading Hugging Face folders: config, streamed tensors, `load_model` logits, bad input."""

import json

import pytest
import torch

from mindspeed_core.errors import CheckpointError, ConfigError
from mindspeed_core.testing import import_sibling
from mindspeed_llm.loading import load_model
from mindspeed_llm.models.hf_io import hf_tensor_index, iter_hf_tensors, read_hf_config

models_hf = import_sibling(__file__, "models_hf")
make_hf, tokens = models_hf.make_hf, models_hf.tokens


@pytest.mark.parametrize(
    ("case", "shard"), [("llama", None), ("qwen2-tied", "40KB"), ("qwen3", "40KB")]
)
def test_load_model_matches_transformers(tmp_path, case, shard):
    hf = make_hf(case)
    hf.save_pretrained(tmp_path, **({"max_shard_size": shard} if shard else {}))
    if shard:
        assert (tmp_path / "model.safetensors.index.json").is_file()
    model, config = load_model(tmp_path, dtype=torch.float32)
    assert config.family == case.split("-")[0]
    ids = tokens()
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf(ids).logits, atol=1e-5, rtol=0)


def test_iter_hf_tensors_streams_every_tensor(tmp_path):
    hf = make_hf("llama")
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    expected = hf.state_dict()
    seen = dict(iter_hf_tensors(tmp_path))
    assert seen.keys() == expected.keys()
    for name, tensor in seen.items():
        assert torch.equal(tensor, expected[name])
    assert {info.shape for info in hf_tensor_index(tmp_path).values()} == {
        tuple(t.shape) for t in expected.values()
    }


def test_bad_folders(tmp_path):
    with pytest.raises(ConfigError, match="Hub name"):
        read_hf_config("some-org/some-model")
    with pytest.raises(ConfigError, match="has no config.json"):
        read_hf_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ConfigError, match=r"config.json.*'gpt2'.*supported.*llama.*qwen3"):
        read_hf_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 8}))
    with pytest.raises(
        ConfigError, match=r"config.json: the Hugging Face config has no 'hidden_size'"
    ):
        read_hf_config(tmp_path)


def test_truncated_safetensors_is_named(tmp_path):
    make_hf("llama").save_pretrained(tmp_path)
    file = tmp_path / "model.safetensors"
    file.write_bytes(file.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=r"model.safetensors is truncated"):
        load_model(tmp_path)
    file.write_bytes(b"\x05")
    with pytest.raises(CheckpointError, match=r"model.safetensors is truncated"):
        list(iter_hf_tensors(tmp_path))


def test_an_index_naming_files_outside_the_folder_is_refused(tmp_path):
    make_hf("llama").save_pretrained(tmp_path / "model", max_shard_size="40KB")
    index_path = tmp_path / "model" / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    first = next(iter(index["weight_map"]))
    (tmp_path / "outside.safetensors").write_bytes(b"")
    for name in ("../outside.safetensors", str(tmp_path / "outside.safetensors"), "a/../../x"):
        index["weight_map"][first] = name
        index_path.write_text(json.dumps(index))
        with pytest.raises(CheckpointError, match="lies outside the model folder"):
            hf_tensor_index(tmp_path / "model")

