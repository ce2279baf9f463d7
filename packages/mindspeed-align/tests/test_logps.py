"""Packed pairs give each sequence the log-prob of its own forward."""

import numpy as np
import pytest
import torch

from mindspeed_align.logps import SLOT_KEY, pack_pairs, sequence_logps, shared_prefix
from mindspeed_core.parallel import ParallelConfig
from mindspeed_llm.data.collate import IGNORE_INDEX, forward_packed
from mindspeed_llm.models import build_model_config
from mindspeed_llm.train.build import build_model

SEQ = 48


def _sample(rng, prompt, reply_len):
    ids = np.concatenate([prompt, rng.integers(8, 500, reply_len)])
    labels = np.full(len(ids), IGNORE_INDEX)
    labels[len(prompt) - 1 : -1] = ids[len(prompt) :]  # shifted: predict the reply
    return ids, labels


def _pairs():
    rng = np.random.default_rng(0)
    pairs = []
    for prompt_len, chosen_len, rejected_len in [(5, 3, 6), (9, 4, 2), (3, 7, 7), (12, 5, 1), (4, 2, 9)]:
        prompt = rng.integers(8, 500, prompt_len)
        pairs.append((_sample(rng, prompt, chosen_len), _sample(rng, prompt, rejected_len)))
    return pairs


def _alone(model, ids, labels):
    """Sum of the supervised tokens' log-probs from a forward of this sequence alone."""
    ids, labels = torch.as_tensor(ids)[None], torch.as_tensor(labels)[None]
    logits = model(ids, torch.arange(ids.shape[1])[None], torch.tensor([0, ids.shape[1]], dtype=torch.int32))
    logp = torch.log_softmax(logits.float(), -1)[0]
    keep = labels[0] != IGNORE_INDEX
    return logp[keep].gather(-1, labels[0][keep][:, None]).sum(), keep.sum()


def test_packed_pairs_equal_separate_forwards():
    config = build_model_config("llama", flavor="debug", ops_impl="reference")
    parallel = ParallelConfig()
    dims = parallel.dims(1).build("cpu")
    model = build_model(config, dims, torch.device("cpu"), parallel=parallel, seq_len=SEQ, frozen=True).parts[0]
    pairs = _pairs()
    batch = pack_pairs(pairs, SEQ, pad_id=0)
    assert batch["input_ids"].shape[0] < len(pairs)  # several pairs share a row
    with torch.no_grad():
        logits = model(batch["input_ids"], batch["position_ids"], batch["cu_seqlens"])
        logps, counts = sequence_logps(logits, batch["labels"], batch[SLOT_KEY], 2 * len(pairs))
        expected = [_alone(model, *sample) for pair in pairs for sample in pair]
    torch.testing.assert_close(logps, torch.stack([e[0] for e in expected]), rtol=1e-5, atol=1e-5)
    assert counts.tolist() == [float(e[1]) for e in expected] == [3, 6, 4, 2, 7, 7, 5, 1, 2, 9]


@pytest.mark.parametrize("impl", ["reference", "cpu"])
def test_shared_prompts_equal_separate_forwards(impl):
    """`share_prompts`: each pair's prompt (but its last token) once in the row, chosen and
    rejected attending to it: every sequence's log-prob and every gradient equal those of
    the sequences' own forwards (fp32, 1e-5), in fewer tokens."""
    config = build_model_config("llama", flavor="debug", ops_impl=impl)
    parallel = ParallelConfig()
    dims = parallel.dims(1).build("cpu")
    model = build_model(config, dims, torch.device("cpu"), parallel=parallel, seq_len=SEQ).parts[0]
    pairs = _pairs()
    assert [shared_prefix(p) for p in pairs] == [4, 8, 2, 11, 3]  # the prompts but their last token
    batch = pack_pairs(pairs, SEQ, pad_id=0, share_prompts=True)
    separate = pack_pairs(pairs, SEQ, pad_id=0)
    supervised = lambda b: int((b["labels"] != IGNORE_INDEX).sum())  # noqa: E731
    assert supervised(batch) == supervised(separate)
    assert batch["input_ids"].shape[0] <= separate["input_ids"].shape[0]
    assert int((batch[SLOT_KEY] >= 0).sum()) == int((separate[SLOT_KEY] >= 0).sum()) - sum([4, 8, 2, 11, 3])
    logits = forward_packed(model, batch)
    logps, counts = sequence_logps(logits, batch["labels"], batch[SLOT_KEY], 2 * len(pairs))
    weights = torch.randn(2 * len(pairs))
    grads = torch.autograd.grad((logps * weights).sum(), list(model.parameters()))
    expected = [_alone(model, *sample) for pair in pairs for sample in pair]
    want = torch.stack([e[0] for e in expected])
    want_grads = torch.autograd.grad((want * weights).sum(), list(model.parameters()))
    torch.testing.assert_close(logps, want, rtol=1e-5, atol=1e-5)
    assert counts.tolist() == [float(e[1]) for e in expected]
    for got, ref in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)


def test_shared_prompts_where_they_cannot_run():
    """`dpo.shared_prompts`: auto turns off (and says why) under pipeline or context parallel,
    MTP or layers other than softmax attention; on is refused there in one line; off is off."""
    from types import SimpleNamespace

    from mindspeed_align.common import shares_prompts
    from mindspeed_core.errors import ConfigError
    from mindspeed_llm.models.common.attention import Attention

    def run(pp=1, cp=1, mtp=0, mixer=Attention):
        block = SimpleNamespace(attention=object.__new__(mixer))
        model = SimpleNamespace(modules=lambda: [block])
        return SimpleNamespace(dims=SimpleNamespace(pp=pp, cp=cp), policy=SimpleNamespace(model=model),
                               model_config=SimpleNamespace(num_nextn_predict_layers=mtp))  # fmt: skip

    class GatedDeltaNet:
        pass

    assert shares_prompts("auto", run(), "dpo") and shares_prompts("on", run(), "dpo")
    assert not shares_prompts("off", run(), "dpo")
    for bad, why in ((run(pp=2), "pipeline or context parallel"), (run(cp=2), "pipeline or context"),
                     (run(mtp=1), "MTP"), (run(mixer=GatedDeltaNet), "GatedDeltaNet layers")):  # fmt: skip
        assert not shares_prompts("auto", bad, "dpo")
        with pytest.raises(ConfigError, match=f"dpo.shared_prompts=on: prompts cannot be shared under {why}"):
            shares_prompts("on", bad, "dpo")
