"""EOD-aware positions and cu_seqlens, against a slow loop and Megatron's rule."""

import pytest
import torch

from mindspeed_llm.data import packed_positions

EOD = 0


def _slow(tokens, eod, reset_position_ids, reset_attention_mask):
    """Megatron's get_ltor_masks_and_position_ids loop, plus boundaries in one pass."""
    batch, seq = tokens.shape
    positions = torch.arange(seq).repeat(batch, 1)
    boundaries = []
    for b in range(batch):
        boundaries.append(b * seq)
        previous = 0
        for i in range(seq):
            if tokens[b, i] != eod or i + 1 == seq:
                continue
            if reset_position_ids:
                positions[b, i + 1 :] -= i + 1 - previous
                previous = i + 1
            if reset_attention_mask:
                boundaries.append(b * seq + i + 1)
    boundaries.append(batch * seq)
    return positions, torch.tensor(boundaries, dtype=torch.int32)


@pytest.mark.parametrize("reset_position_ids", [True, False])
@pytest.mark.parametrize("reset_attention_mask", [True, False])
def test_matches_slow_loop(reset_position_ids, reset_attention_mask):
    generator = torch.Generator().manual_seed(0)
    for batch, seq in [(1, 1), (3, 17), (4, 64)]:
        tokens = torch.randint(0, 5, (batch, seq), generator=generator)  # ~20% EOD
        tokens[0, -1] = EOD  # an EOD closing a row adds no extra boundary
        positions, cu_seqlens = packed_positions(
            tokens,
            EOD,
            reset_position_ids=reset_position_ids,
            reset_attention_mask=reset_attention_mask,
        )
        expected_positions, expected_cu = _slow(
            tokens, EOD, reset_position_ids, reset_attention_mask
        )
        assert positions.dtype == torch.int64 and cu_seqlens.dtype == torch.int32
        torch.testing.assert_close(positions, expected_positions)
        torch.testing.assert_close(cu_seqlens, expected_cu)


def test_small_example():
    tokens = torch.tensor([[5, 6, EOD, 7, EOD, 8], [EOD, 9, 9, 9, 9, 9]])
    positions, cu_seqlens = packed_positions(tokens, EOD)
    assert positions.tolist() == [[0, 1, 2, 0, 1, 0], [0, 0, 1, 2, 3, 4]]
    # documents: [5 6 EOD] [7 EOD] [8] | [EOD] [9 9 9 9 9]
    assert cu_seqlens.tolist() == [0, 3, 5, 6, 7, 12]
    segment_lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    assert sum(segment_lengths) == tokens.numel() and min(segment_lengths) > 0
    _, only_samples = packed_positions(tokens, EOD, reset_attention_mask=False)
    assert only_samples.tolist() == [0, 6, 12]
