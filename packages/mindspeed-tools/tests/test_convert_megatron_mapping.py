"""The Megatron table (`convert.megatron.mapping`) both ways, against layouts written out here
by hand from Megatron-Core's GPTModel: per query group [its q heads | k | v] in linear_qkv,
[gate; up] in linear_fc1, and under tensor parallelism each rank's fc1 [gate_r; up_r].
The checkpoints themselves are checked against megatron-core in test_convert_megatron.py."""

from pathlib import Path

import pytest
import torch

from mindspeed_core.errors import CheckpointError
from mindspeed_tools.convert.megatron.mapping import (
    Heads,
    to_hf_tensors,
    to_megatron,
    tp_merge,
    tp_split,
)

HEADS, GROUPS, D, HIDDEN, FFN, LAYERS = 4, 2, 3, 8, 6, 2


def _hf_config(model_type: str, tied: bool = False) -> dict:
    return {
        "model_type": model_type,
        "num_attention_heads": HEADS,
        "num_key_value_heads": GROUPS,
        "head_dim": D,
        "tie_word_embeddings": tied,
    }


def _dense_hf(qk_norm: bool = False, bias: bool = False) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = {"model.embed_tokens.weight": (16, HIDDEN), "model.norm.weight": (HIDDEN,),
              "lm_head.weight": (16, HIDDEN)}  # fmt: skip
    for i in range(LAYERS):
        at = f"model.layers.{i}."
        shapes |= {
            at + "input_layernorm.weight": (HIDDEN,),
            at + "self_attn.q_proj.weight": (HEADS * D, HIDDEN),
            at + "self_attn.k_proj.weight": (GROUPS * D, HIDDEN),
            at + "self_attn.v_proj.weight": (GROUPS * D, HIDDEN),
            at + "self_attn.o_proj.weight": (HIDDEN, HEADS * D),
            at + "post_attention_layernorm.weight": (HIDDEN,),
            at + "mlp.gate_proj.weight": (FFN, HIDDEN),
            at + "mlp.up_proj.weight": (FFN, HIDDEN),
            at + "mlp.down_proj.weight": (HIDDEN, FFN),
        }
        if qk_norm:
            shapes |= {at + "self_attn.q_norm.weight": (D,), at + "self_attn.k_norm.weight": (D,)}
        if bias:
            shapes |= {at + f"self_attn.{p}_proj.bias": (n * D,)
                       for p, n in (("q", HEADS), ("k", GROUPS), ("v", GROUPS))}  # fmt: skip
    return {n: torch.randn(s, generator=g) for n, s in shapes.items()}


def _by_hand_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Megatron's linear_qkv rows: group 0's q heads, its k head, its v head, then group 1..."""
    per = HEADS // GROUPS
    rows = []
    for group in range(GROUPS):
        for head in range(group * per, (group + 1) * per):
            rows.append(q[head * D : (head + 1) * D])
        rows.append(k[group * D : (group + 1) * D])
        rows.append(v[group * D : (group + 1) * D])
    return torch.cat(rows)


@pytest.mark.parametrize(("model_type", "qk_norm", "bias"), [("llama", False, False),
                                                             ("qwen3", True, False),
                                                             ("qwen2", False, True)])  # fmt: skip
def test_the_writer_lays_out_as_megatron_and_the_reader_undoes_it(model_type, qk_norm, bias):
    hf = _dense_hf(qk_norm, bias)
    heads = Heads(HEADS, GROUPS, D)
    ours = to_megatron(hf, heads, LAYERS, model_type=model_type)
    at = "model.layers.1."
    qkv = _by_hand_qkv(*(hf[f"{at}self_attn.{p}_proj.weight"] for p in "qkv"))
    assert torch.equal(ours["decoder.layers.1.self_attention.linear_qkv.weight"], qkv)
    fc1 = torch.cat([hf[at + "mlp.gate_proj.weight"], hf[at + "mlp.up_proj.weight"]])
    assert torch.equal(ours["decoder.layers.1.mlp.linear_fc1.weight"], fc1)
    assert ("decoder.layers.0.self_attention.q_layernorm.weight" in ours) == qk_norm
    assert ("decoder.layers.0.self_attention.linear_qkv.bias" in ours) == bias
    # the names megatron-core's local-spec GPTModel gives its layer-0 tensors
    expected = {"input_layernorm.weight", "self_attention.linear_qkv.weight",
                "self_attention.linear_proj.weight", "pre_mlp_layernorm.weight",
                "mlp.linear_fc1.weight", "mlp.linear_fc2.weight"}  # fmt: skip
    if qk_norm:
        expected |= {"self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight"}
    if bias:
        expected.add("self_attention.linear_qkv.bias")
    layer0 = {
        n.removeprefix("decoder.layers.0.") for n in ours if n.startswith("decoder.layers.0.")
    }
    assert layer0 == expected
    back = to_hf_tensors(ours, _hf_config(model_type), Path("m"))
    assert back.keys() == hf.keys()
    assert all(torch.equal(back[n], hf[n]) for n in hf)


def test_a_tied_model_gets_its_embedding_as_megatrons_output_layer_and_back_none():
    hf = _dense_hf()
    del hf["lm_head.weight"]
    ours = to_megatron(hf, Heads(HEADS, GROUPS, D), LAYERS, model_type="llama")
    assert torch.equal(ours["output_layer.weight"], hf["model.embed_tokens.weight"])
    back = to_hf_tensors(ours, _hf_config("llama", tied=True), Path("m"))
    assert back.keys() == hf.keys()


@pytest.mark.parametrize(
    ("model_type", "gate", "up", "down", "block"),
    [("mixtral", "w1", "w3", "w2", "block_sparse_moe"),
     ("qwen3_moe", "gate_proj", "up_proj", "down_proj", "mlp")],
)  # fmt: skip
def test_experts_and_router_both_ways(model_type, gate, up, down, block):
    g = torch.Generator().manual_seed(1)
    ours = {"decoder.layers.0.mlp.router.weight": torch.randn(3, HIDDEN, generator=g)}
    for e in range(3):
        ours[f"decoder.layers.0.mlp.experts.{e}.linear_fc1.weight"] = torch.randn(2 * FFN, HIDDEN)
        ours[f"decoder.layers.0.mlp.experts.{e}.linear_fc2.weight"] = torch.randn(HIDDEN, FFN)
    hf = to_hf_tensors(ours, _hf_config(model_type), Path("m"))
    fc1 = ours["decoder.layers.0.mlp.experts.2.linear_fc1.weight"]
    assert torch.equal(hf[f"model.layers.0.{block}.experts.2.{gate}.weight"], fc1[:FFN])
    assert torch.equal(hf[f"model.layers.0.{block}.experts.2.{up}.weight"], fc1[FFN:])
    assert f"model.layers.0.{block}.experts.1.{down}.weight" in hf
    assert f"model.layers.0.{block}.gate.weight" in hf
    again = to_megatron(hf, Heads(HEADS, GROUPS, D), 1, model_type=model_type, num_experts=3)
    assert again.keys() == ours.keys() and all(torch.equal(again[n], ours[n]) for n in ours)


def test_a_dense_model_refuses_expert_tensors_naming_them():
    ours = {"decoder.layers.0.mlp.router.weight": torch.zeros(3, HIDDEN)}
    with pytest.raises(CheckpointError, match=r"mlp\.router\.weight has no Hugging Face .* dense"):
        to_hf_tensors(ours, _hf_config("llama"), Path("m"))


def test_tensor_parallel_shards_are_megatrons_and_merge_back():
    tp = 2
    gate, up = torch.arange(24.0).reshape(4, 6), 100 + torch.arange(24.0).reshape(4, 6)
    fc1 = torch.cat([gate, up])
    shards = [tp_split("decoder.layers.3.mlp.linear_fc1.weight", fc1, tp, r) for r in range(tp)]
    assert torch.equal(shards[1], torch.cat([gate[2:], up[2:]]))  # [gate_r; up_r]
    assert torch.equal(tp_merge("decoder.layers.3.mlp.linear_fc1.weight", shards), fc1)
    expert = "decoder.layers.0.mlp.experts.5.linear_fc1.weight"
    assert torch.equal(tp_split(expert, fc1, tp, 0), torch.cat([gate[:2], up[:2]]))
    proj = torch.arange(12.0).reshape(3, 4)
    name = "decoder.layers.0.self_attention.linear_proj.weight"  # row parallel: columns cut
    assert torch.equal(tp_split(name, proj, tp, 1), proj[:, 2:])
    assert torch.equal(tp_merge(name, [proj[:, :2], proj[:, 2:]]), proj)
    norm = torch.ones(4)  # held whole by every rank
    assert tp_split("decoder.final_layernorm.weight", norm, tp, 1) is norm
    vocab = torch.arange(8.0).reshape(4, 2)
    assert torch.equal(tp_split("embedding.word_embeddings.weight", vocab, tp, 1), vocab[2:])
