"""Packed pairs give each sequence the log-prob of its own forward."""

import numpy as np
import torch

from mindspeed_align.logps import SLOT_KEY, pack_pairs, sequence_logps
from mindspeed_core.parallel import ParallelConfig
from mindspeed_llm.data.collate import IGNORE_INDEX
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
