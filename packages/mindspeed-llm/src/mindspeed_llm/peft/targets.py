"""The linear layers LoRA can adapt, in our names and Hugging Face's (a module of its own so
`lora` and `qlora` share it without importing each other)."""

HF_NAMES = {
    "wq": "q_proj",
    "wk": "k_proj",
    "wv": "v_proj",
    "wo": "o_proj",
    "w1": "gate_proj",
    "w3": "up_proj",
    "w2": "down_proj",
}
"""Our linear layers' names -> Hugging Face's (`lora.targets` accepts both)."""
