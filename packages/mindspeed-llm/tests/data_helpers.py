"""Shared by the data tests: small corpora written with our writer, Megatron imports."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np

from mindspeed_llm.data import IndexedDatasetWriter


def write_corpus(
    prefix: Path,
    num_documents: int,
    *,
    seed: int = 0,
    vocab: int = 1000,
    max_len: int = 60,
    min_len: int = 1,
    eod: int | None = None,
    dtype=np.uint16,
) -> list[np.ndarray]:
    """Random documents (one sequence each) written at `prefix`; returns them."""
    rng = np.random.default_rng(seed)
    documents = []
    with IndexedDatasetWriter(prefix, dtype) as writer:
        for length in rng.integers(min_len, max_len + 1, size=num_documents):
            doc = rng.integers(1, vocab, size=int(length))
            if eod is not None and length:
                doc[-1] = eod
            writer.add_document(doc)
            documents.append(doc)
    return documents


def megatron_datasets():
    """Megatron-Core's datasets module (imports on CPU; its warnings silenced)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets import indexed_dataset

    return indexed_dataset


def megatron_gpt():
    """(GPTDataset, GPTDatasetConfig, BlendedMegatronDatasetBuilder, helpers) of Megatron-Core."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets import helpers
        from megatron.core.datasets.blended_megatron_dataset_builder import (
            BlendedMegatronDatasetBuilder,
        )
        from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    return GPTDataset, GPTDatasetConfig, BlendedMegatronDatasetBuilder, helpers


class MegatronTokenizerStub:
    """What Megatron's GPTDatasetConfig reads from a tokenizer."""

    vocab_size = 1000
    eod = 0
    pad = 1000  # outside the corpus ids: Megatron rewrites pad tokens it meets
    unique_identifiers = {"class": "MegatronTokenizerStub"}
