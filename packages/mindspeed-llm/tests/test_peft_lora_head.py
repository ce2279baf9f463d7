"""LoRA on the output layer (`lora.targets: [lm_head]`, peft's `target_modules=["lm_head"]`):
logits and A/B gradients equal peft's on the transformers model of the same weights (fp32,
1e-5), the merge equals the adapted model, the fused linear + cross-entropy path (which
reads the head's weight alone) is not taken while the head has an adapter, and a head the
adapter cannot go on (tied, vocabulary-padded, pipelined) is one line."""

import types

import pytest
import torch

from mindspeed_core.errors import ConfigError
from mindspeed_core.testing import import_sibling
from mindspeed_llm.models import build_model_config, get_model_spec
from mindspeed_llm.peft import LoRAConfig, apply_lora, lora_transform, merge_lora, merged_state
from mindspeed_llm.peft.names import hf_module_names, to_peft_names

models_hf = import_sibling(__file__, "models_hf")
peft_tests = import_sibling(__file__, "test_peft_lora")
peft = pytest.importorskip("peft")


def test_lm_head_lora_equals_peft_and_merges():
    hf = models_hf.make_hf("llama")
    ours = models_hf.ours_from(hf).train()
    plain = models_hf.ours_from(hf)  # the base, before peft wraps hf's modules in place
    assert ours.fuses_nll
    lora = LoRAConfig(rank=4, alpha=8, targets=["q_proj", "lm_head"])
    assert apply_lora(ours, lora) == ["layers.0.attention.wq", "layers.1.attention.wq", "output"]
    assert not ours.fuses_nll  # the fused op reads output.weight alone: it would skip the adapter
    x = models_hf.tokens()
    with pytest.raises(ValueError, match="token_nll needs the whole, plain output projection"):
        ours(x, nll_labels=x)
    peft_tests._randomise_b(ours)
    theirs = peft.get_peft_model(hf, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                 target_modules=["q_proj", "lm_head"])).train()  # fmt: skip
    mine = {k: p for k, p in ours.named_parameters() if p.requires_grad}
    assert sorted(k for k in mine if k.startswith("output.")) == [
        "output.lora_A.weight", "output.lora_B.weight"]  # fmt: skip
    modules = {k.rsplit(".", 2)[0] for k in mine}
    assert hf_module_names(modules, ours.config) == ["lm_head", "q_proj"]
    names, params = to_peft_names(mine, ours.config), dict(theirs.named_parameters())
    pairs = [(p, params[names[k].replace(".weight", ".default.weight")]) for k, p in mine.items()]
    with torch.no_grad():
        for p, q in pairs:
            q.copy_(p)
    opt_ours = torch.optim.AdamW([p for p, _ in pairs], lr=1e-2)
    opt_theirs = torch.optim.AdamW([q for _, q in pairs], lr=1e-2)
    for step in range(2):
        logits, peft_logits = ours(x), theirs(input_ids=x).logits
        torch.testing.assert_close(logits, peft_logits, atol=1e-5, rtol=1e-5, msg=f"step {step}")
        peft_tests._loss(logits, x).backward()
        peft_tests._loss(peft_logits, x).backward()
        for p, q in pairs:
            torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4)
        assert all(p.grad.abs().sum() > 0 for p, _ in pairs)
        opt_ours.step(), opt_theirs.step(), opt_ours.zero_grad(), opt_theirs.zero_grad()

    ours.eval()
    with torch.no_grad():
        want = ours(x)
        state = merged_state(ours.state_dict(), lora.scaling)
        assert not torch.equal(state["output.weight"], plain.output.weight)  # folded in
        plain.load_state_dict(state)
        torch.testing.assert_close(plain(x), want, atol=1e-5, rtol=1e-5)
        merge_lora(ours)
        assert ours.fuses_nll  # the plain head again
        torch.testing.assert_close(ours(x), want, atol=1e-5, rtol=1e-5)


def test_a_head_the_adapter_cannot_go_on_is_one_line():
    lora = LoRAConfig(rank=4, targets=["v_proj", "lm_head"])
    spec = get_model_spec("llama")
    cases = {
        "its weight is the embedding's (tie_word_embeddings)": {"tie_word_embeddings": True},
        "it has 640 rows for a vocabulary of 512": {"padded_vocab_size": 640},
    }
    for expected, change in cases.items():
        model = spec.build(build_model_config("llama", "debug", **change))
        with pytest.raises(ConfigError, match="lm_head") as err:
            apply_lora(model, lora)
        assert expected in str(err.value) and "\n" not in str(err.value)
        assert not any(".lora_" in n for n, _ in model.named_parameters())  # refused first
    model = spec.build(build_model_config("llama", "debug"))
    with pytest.raises(ConfigError, match=r"lm_head \(the output layer\) is not adapted under "
                                          r"parallel.pp=2"):  # fmt: skip
        lora_transform(lora)(model, types.SimpleNamespace(pp=2))
    assert lora_transform(LoRAConfig(rank=4))(model, types.SimpleNamespace(pp=2)) == set()
    assert not hasattr(model.output, "lora_A")  # the default targets leave the head alone
