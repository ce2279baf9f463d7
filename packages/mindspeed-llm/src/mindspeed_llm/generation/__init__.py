"""Generation with a KV cache: greedy and sampled decoding, stops, batches, streaming, beam search.

from mindspeed_llm.generation import GenerationConfig, Generator, generate

tokens = generate(model, [[1, 15, 27]], GenerationConfig(max_new_tokens=32))
text = Generator(model, tokenizer).generate(["Once upon a time"], temperature=0.7, seed=0)
for piece in Generator(model, tokenizer).stream("Hello", stop_strings=["\\n"]):
    print(piece, end="", flush=True)
"""

from mindspeed_llm.generation.beam import Beam, beam_search
from mindspeed_llm.generation.config import GenerationConfig, load_generation_config
from mindspeed_llm.generation.engine import TokenSteps, generate
from mindspeed_llm.generation.kv_cache import KVCache
from mindspeed_llm.generation.sampling import next_tokens, process_logits
from mindspeed_llm.generation.text import Completion, Generator, TextStream

__all__ = [
    "Beam",
    "Completion",
    "GenerationConfig",
    "Generator",
    "KVCache",
    "TextStream",
    "TokenSteps",
    "beam_search",
    "generate",
    "load_generation_config",
    "next_tokens",
    "process_logits",
]
