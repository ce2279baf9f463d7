"""Positions and document boundaries of packed (EOD-separated) pretraining samples.

A pretraining sample concatenates documents, each ending with an EOD token. With
`reset_position_ids` the positions restart at 0 after every EOD (Megatron's
`get_ltor_masks_and_position_ids`); with `reset_attention_mask` attention stays
inside each document, which varlen attention kernels take as `cu_seqlens`.
"""

from __future__ import annotations

import torch

__all__ = ["packed_positions"]


def packed_positions(
    tokens: torch.Tensor,
    eod_id: int,
    *,
    reset_position_ids: bool = True,
    reset_attention_mask: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Position ids and cumulative sequence lengths for a packed batch.

    A document ends right after its EOD token (the EOD belongs to the document it
    closes); every sample boundary is also a boundary, so no document crosses rows.

    Args:
        tokens: (batch, seq) token ids.
        eod_id: the end-of-document token id.
        reset_position_ids: restart positions at 0 after each EOD; else 0..seq-1 per row.
        reset_attention_mask: boundaries after each EOD in `cu_seqlens`; else only
            the sample boundaries.

    Returns:
        position_ids: (batch, seq) int64.
        cu_seqlens: (num_segments + 1,) int32 offsets into the flattened batch * seq
            tokens, starting at 0 and ending at batch * seq.
    """
    if tokens.dim() != 2:
        raise ValueError(f"tokens must be (batch, seq), got shape {tuple(tokens.shape)}")
    batch, seq = tokens.shape
    device = tokens.device
    # (batch, seq): True where a new document starts; column 0 always starts one.
    starts = torch.zeros(batch, seq, dtype=torch.bool, device=device)
    starts[:, 0] = True
    starts[:, 1:] = tokens[:, :-1] == eod_id
    columns = torch.arange(seq, device=device).expand(batch, seq)

    if reset_position_ids:
        last_start = torch.where(starts, columns, torch.zeros_like(columns))
        last_start = torch.cummax(last_start, dim=1).values
        position_ids = columns - last_start
    else:
        position_ids = columns.clone()

    if reset_attention_mask:
        boundaries = torch.nonzero(starts.reshape(-1), as_tuple=True)[0]
    else:
        boundaries = torch.arange(batch, device=device) * seq
    end = torch.tensor([batch * seq], device=device, dtype=boundaries.dtype)
    cu_seqlens = torch.cat([boundaries, end]).to(torch.int32)
    return position_ids, cu_seqlens
