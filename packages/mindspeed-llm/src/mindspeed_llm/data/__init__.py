"""Pretraining data: Megatron-compatible indexed datasets, GPT samples, blends, packing."""

from mindspeed_llm.data.blended import (
    BlendedDataset,
    blending_indices,
    build_pretrain_datasets,
    parse_data_paths,
    parse_split,
    split_document_ranges,
)
from mindspeed_llm.data.gpt_dataset import GPTDataset, build_gpt_indices
from mindspeed_llm.data.indexed import (
    DTYPE_CODES,
    IndexedDataset,
    IndexedDatasetWriter,
    best_dtype,
    dataset_exists,
)
from mindspeed_llm.data.packing import packed_positions

__all__ = [
    "DTYPE_CODES",
    "BlendedDataset",
    "GPTDataset",
    "IndexedDataset",
    "IndexedDatasetWriter",
    "best_dtype",
    "blending_indices",
    "build_gpt_indices",
    "build_pretrain_datasets",
    "dataset_exists",
    "packed_positions",
    "parse_data_paths",
    "parse_split",
    "split_document_ranges",
]
