"""Micro-batches by token budget, balanced over the data-parallel ranks.

Fixed-row micro-batches waste compute twice on data of mixed lengths: a row is padded to
the longest sample of its step, and the rank that happens to draw the long samples holds
every other rank up at the step's gradient reduction. `plan_micro_batches` takes the
step's samples (their token counts), gives each rank an about equal share of the tokens
(the longest sample first, each onto the rank with the fewest tokens so far: Graham's LPT,
within 4/3 of the best split, as verl's sequence-length balancing does) and then packs
each rank's samples, whole, into micro-batches of at most `budget` tokens (best fit
decreasing, `data.sft.pack_rows`).

Every rank runs the same number of micro-batches (FSDP gathers and reduces at every
forward and backward, so a rank with one micro-batch fewer would wait forever): a rank
that packed into fewer splits its fullest micro-batch (most samples) until it has as many,
and only a rank with single-sample micro-batches left gets an empty one (no sample:
nothing supervised, no gradient). The plan depends only on the lengths, so every rank
computes the whole plan and takes its part, without communicating.
"""

from __future__ import annotations

from collections.abc import Sequence

from mindspeed_llm.data.sft import pack_rows

__all__ = ["balance_ranks", "equalise", "plan_micro_batches", "rank_tokens"]


def balance_ranks(lengths: Sequence[int], num_ranks: int) -> list[list[int]]:
    """The indices of each rank, about equal token counts: the longest first, each onto
    the rank with the fewest tokens so far (ties: the lower rank); each rank's in order."""
    ranks: list[list[int]] = [[] for _ in range(num_ranks)]
    loads = [0] * num_ranks
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        lightest = min(range(num_ranks), key=lambda r: (loads[r], r))
        ranks[lightest].append(i)
        loads[lightest] += lengths[i]
    return [sorted(r) for r in ranks]


def plan_micro_batches(
    lengths: Sequence[int], num_ranks: int, budget: int
) -> list[list[list[int]]]:
    """Each rank's micro-batches (lists of indices into `lengths`) of at most `budget`
    tokens each, the same number on every rank (see the module docstring).

    Raises:
        ValueError: a sample is longer than `budget` (the caller names the config field).
    """
    if budget < 1:
        raise ValueError(f"budget={budget} must be positive")
    too_long = [n for n in lengths if n > budget]
    if too_long:
        raise ValueError(f"a sample of {max(too_long)} tokens exceeds the budget of {budget}")
    plans = []
    for mine in balance_ranks(lengths, num_ranks):
        rows = pack_rows([lengths[i] for i in mine], budget) if mine else []
        plans.append([[mine[j] for j in row] for row in rows])
    count = max(1, max(len(p) for p in plans))
    for plan in plans:
        equalise(plan, count)
    return plans


def equalise(plan: list[list[int]], count: int) -> None:
    """Grow `plan` to `count` micro-batches (in place): split off the last sample of the one
    with the most samples, or add an empty one when none has two (a caller whose ranks plan
    apart, as RL's do, passes the most micro-batches any rank planned)."""
    while len(plan) < count:
        fullest = max(range(len(plan)), key=lambda b: (len(plan[b]), -b), default=None)
        if fullest is None or len(plan[fullest]) < 2:
            plan.append([])
        else:
            plan.append([plan[fullest].pop()])


def rank_tokens(lengths: Sequence[int], plans: Sequence[Sequence[Sequence[int]]]) -> list[int]:
    """The tokens each rank's micro-batches hold (for the max/min log line)."""
    return [sum(lengths[i] for mb in plan for i in mb) for plan in plans]
