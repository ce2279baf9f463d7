"""One layout check for the trainer, parallelize and `mindspeed convert`: the same rules,
each caller's spelling of the field, refused before any process group exists."""

import pytest
import torch.distributed as dist

from mindspeed_core.errors import ConfigError, ParallelError
from mindspeed_core.parallel import ParallelConfig, ParallelDims
from mindspeed_llm.models import build_model_config, get_model_spec
from mindspeed_llm.models.common.layout import LayoutError, check_layout, layout_of


def _llama(**changes):
    return build_model_config("llama", flavor="debug", **changes)


@pytest.mark.parametrize(
    ("flag", "spelled"), [("parallel.{}", "parallel.tp=2"), ("--{}", "--tp=2"), ("{}", "tp=2")]
)
def test_any_vocabulary_and_tied_embeddings_pass_tp_but_the_heads_must_divide(flag, spelled):
    odd = _llama(vocab_size=777, tie_word_embeddings=True)
    assert check_layout(odd, ParallelConfig(tp=2), flag=flag) is None  # padded, not refused
    assert (odd.padded_vocab(1), odd.padded_vocab(2), odd.padded_vocab(4)) == (777, 1024, 1024)
    assert _llama(vocab_size=777, vocab_divisible_by=1).padded_vocab(2) == 778
    with pytest.raises(LayoutError, match=f"^{spelled} does not divide num_kv_heads=1"):
        check_layout(_llama(num_kv_heads=1), ParallelConfig(tp=2), flag=flag)
    with pytest.raises(ConfigError, match="vocab_divisible_by=0 must be a positive integer"):
        _llama(vocab_divisible_by=0)
    assert not dist.is_initialized()


def test_a_layout_error_is_a_config_and_a_parallel_error():
    assert issubclass(LayoutError, ConfigError) and issubclass(LayoutError, ParallelError)


@pytest.mark.parametrize(
    ("parallel", "seq_len", "message"),
    [
        ({"tp": 4}, None, "parallel.tp=4 does not divide num_kv_heads=2 of this model"),
        ({"tp": 0}, None, "parallel.tp=0 must be >= 1"),
        ({"pp": 2}, None, None),
        ({"pp": 3}, None, "parallel.pp=3: 3 pipeline stages"),
        ({"virtual_stages": 2}, None, "parallel.virtual_stages=2 needs parallel.pp > 1"),
        ({"cp": 2}, 30, "data.seq_len=30 is not divisible by 2 x parallel.cp = 4"),
        ({"cp": 2, "pp": 2}, None, "parallel.cp=2 with parallel.pp=2 is not supported yet"),
        ({"ep": 2}, None, "parallel.ep=2 needs a MoE model"),
    ],
)
def test_rules_name_the_field(parallel, seq_len, message):
    if message is None:
        assert check_layout(_llama(), ParallelConfig(**parallel), seq_len=seq_len) == [1, 1]
        return
    with pytest.raises(LayoutError, match=message.replace("(", r"\(")):
        check_layout(_llama(), ParallelConfig(**parallel), seq_len=seq_len)


def test_parallelize_checks_built_dims_with_the_same_rules():
    layout = layout_of(ParallelDims(tp=2, world_size=2), cp_mode="ring", ulysses_degree=None)
    assert (layout.tp, layout.cp, layout.dp_shard, layout.cp_mode) == (2, 1, 1, "ring")
    spec = get_model_spec("llama")
    model = spec.build(_llama(num_kv_heads=1, num_heads=4))
    with pytest.raises(LayoutError, match="^tp=2 does not divide num_kv_heads=1"):
        spec.parallelize(model, ParallelDims(tp=2, world_size=2))
