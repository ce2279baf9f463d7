"""One helper to describe a family of our decoder: its sizes and its Hugging Face spelling.

Every built-in family is the shared `Transformer` with its own flags, so what a family
folder holds is data: `flavors.py` (named sizes) and `hf.py` (its `config.json` format and,
for MoE, its weight names). `decoder_family` turns those into the `ModelSpec` the
registry keeps.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mindspeed_llm.models.common import hf_adapter as dense_adapter
from mindspeed_llm.models.common.parallelize import parallelize_decoder, pipeline_decoder
from mindspeed_llm.models.common.transformer import Transformer
from mindspeed_llm.models.config import TransformerConfig
from mindspeed_llm.models.hf_format import HFFormat
from mindspeed_llm.models.registry import ModelSpec


def decoder_family(
    name: str,
    flavors: Mapping[str, TransformerConfig],
    hf: HFFormat,
    *,
    hf_adapter: Any = dense_adapter,
    pipeline: bool = True,
) -> ModelSpec:
    """The `ModelSpec` of a family of the shared decoder.

    Args:
        name: family name (every flavor's `family`).
        flavors: named sizes, with a CPU-sized "debug".
        hf: its `config.json` format (`common.hf_config.decoder_format`).
        hf_adapter: its weight names (default: the dense families' `hf_adapter`).
        pipeline: whether the family supports pipeline parallel.
    """
    return ModelSpec(
        name=name,
        flavors=flavors,
        build=Transformer,
        parallelize=parallelize_decoder,
        hf_adapter=hf_adapter,
        pipeline=pipeline_decoder if pipeline else None,
        hf=hf,
    )


def debug_flavor(family: str, **changes: Any) -> TransformerConfig:
    """The CPU-sized "debug" model: 2 blocks of width 64, 4 query heads over 2 key/value
    heads, a 512-token vocabulary; `changes` add the family's flags."""
    return TransformerConfig(
        family=family,
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        max_position_embeddings=256,
        **changes,
    )
