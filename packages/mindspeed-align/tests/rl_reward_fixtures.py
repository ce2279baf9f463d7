"""Reward functions that misbehave, for the worker tests (importable by spawned workers)."""

import time


def raises(prompts, completions, **_):
    if "boom" in completions[0]:
        raise RuntimeError("boom")
    return [1.0 for _ in completions]


def hangs(prompts, completions, **_):
    if "hang" in completions[0]:
        time.sleep(60)
    return [0.5 for _ in completions]


def nan_for_odd(prompts, completions, **_):
    return [float("nan") if "odd" in c else 1.0 for c in completions]


def one_score_too_many(prompts, completions, **_):
    return [1.0 for _ in completions] + [1.0]


def text_length(prompts, completions, **_):
    """Varies with the text (the vLLM stand-in's scripted samples get different rewards)."""
    return [(len(c) % 5) / 4 for c in completions]
