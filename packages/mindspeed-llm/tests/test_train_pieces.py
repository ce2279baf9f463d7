"""Unit tests of the engine's pieces that need no model: the batch contract, context-parallel
sharding of inputs and targets, the next-token objective's units, weights and sums."""

import pytest
import torch
import torch.nn.functional as F

from mindspeed_core.parallel import packed_shard_index
from mindspeed_llm.data import packed_positions
from mindspeed_llm.data.collate import check_batch, lm_batch, shard_context_parallel
from mindspeed_llm.train.objectives import LossContext, NextToken, segment_ids, token_nll

EOD = 3


def _samples():
    samples = torch.tensor(
        [[5, 6, EOD, 7, 8, 9, 10, 11, 12], [13, 14, 15, 16, EOD, 17, 18, 19, 20]]
    )
    return samples


def test_lm_batch_is_the_contract_pretraining_used():
    batch = lm_batch(_samples(), EOD)
    check_batch(batch)
    assert torch.equal(batch["input_ids"], _samples()[:, :-1])
    assert torch.equal(batch["labels"], _samples()[:, 1:])
    positions, cu = packed_positions(_samples()[:, :-1], EOD)
    assert torch.equal(batch["position_ids"], positions) and torch.equal(batch["cu_seqlens"], cu)
    assert batch["cu_seqlens"].tolist() == [0, 3, 8, 13, 16]
    whole_rows = lm_batch(_samples(), None)
    assert whole_rows["cu_seqlens"].tolist() == [0, 8, 16]


def test_a_broken_batch_is_named():
    batch = lm_batch(_samples(), EOD)
    with pytest.raises(ValueError, match="lacks \\['cu_seqlens'\\]"):
        check_batch({k: v for k, v in batch.items() if k != "cu_seqlens"})
    with pytest.raises(ValueError, match="every row boundary"):
        check_batch({**batch, "cu_seqlens": torch.tensor([0, 3, 13, 16], dtype=torch.int32)})
    with pytest.raises(ValueError, match="labels"):
        check_batch({**batch, "labels": batch["labels"][:, 1:]})


def test_context_parallel_shards_inputs_and_targets_alike():
    batch = lm_batch(_samples(), EOD)
    weights = {
        "labels": batch["labels"],
        "weights": torch.arange(16.0).view(2, 8),
        "n": torch.ones(3),
    }
    index, local_cu = packed_shard_index(batch["cu_seqlens"], 1, 2)
    local, targets = shard_context_parallel(batch, 1, 2, weights)
    assert torch.equal(local["cu_seqlens"], local_cu)
    real = index >= 0
    for key in ("input_ids", "labels", "position_ids"):
        assert local[key].shape == (1, len(index))
        assert torch.equal(local[key][0, real], batch[key].flatten()[index[real]])
    assert (local["labels"][0, ~real] == -100).all() and (local["input_ids"][0, ~real] == 0).all()
    assert torch.equal(targets["weights"][0, real], torch.arange(16.0)[index[real]])
    assert (targets["weights"][0, ~real] == 0).all() and torch.equal(targets["n"], torch.ones(3))
    assert torch.equal(targets["labels"], local["labels"])


def test_next_token_units_weights_and_sums():
    batch = lm_batch(_samples(), EOD)
    batch["labels"][0, :5] = -100  # document 0 unsupervised, document 1 partly
    logits = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(0))
    batch["labels"] = batch["labels"] % 32 * (batch["labels"] >= 0) + -100 * (batch["labels"] < 0)
    ctx = LossContext(ops_impl="reference")
    token, sample = NextToken("token"), NextToken("sample")
    assert token.num_units(batch) == 11 and sample.num_units(batch) == 3
    nll = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="none")
    torch.testing.assert_close(token.loss(logits, token.targets(batch), ctx).loss_sum, nll.sum())
    torch.testing.assert_close(token_nll(logits, batch["labels"], ctx, "none"), nll)
    docs = segment_ids(batch["cu_seqlens"], 16)
    assert docs.tolist() == [0] * 3 + [1] * 5 + [2] * 5 + [3] * 3
    keep = batch["labels"].flatten() != -100
    means = [nll[(docs == d) & keep].mean() for d in range(4) if ((docs == d) & keep).any()]
    got = sample.loss(logits, sample.targets(batch), ctx).loss_sum
    torch.testing.assert_close(got, torch.stack(means).sum())
    with pytest.raises(ValueError, match="normalization='tokens'"):
        NextToken("tokens")


def test_throughput_windows_are_before_and_after_the_first_checkpoint():
    """The pretrain demo's final line: tokens/s over steps 30-90 and 110-300 (checkpoint
    interval 100), from the logged intervals that ran only training steps."""
    from mindspeed_llm.train.loop import throughput_windows

    # 10-step intervals of 1000 tokens; 1 s each before step 100, 2 s after
    paced = [(s - 9, s, 1000, 1.0 if s <= 100 else 2.0) for s in range(10, 301, 10)]
    paced = [p for p in paced if p[1] not in (100, 110, 200, 210, 300)]  # validation, saves
    assert throughput_windows(paced, 100, 300) == {"30-90": 1000.0, "110-300": 500.0}
    assert throughput_windows(paced[:3], 100, 30) == {"0-30": 1000.0}  # stopped early
    assert throughput_windows(paced, 0, 300) == {"0-300": 25_000 / 41}  # no interval
    assert throughput_windows([], 100, 300) == {}
