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
"""Our linear layers' names -> Hugging Face's (`lora.targets` accepts both). w1/w3/w2 name
the dense feed-forward, the shared expert and the routed experts' stacked projections."""

HEAD_NAMES = {"output": "lm_head"}
"""The output projection, ours -> Hugging Face's: adapted only when `lora.targets` names it
(peft's `target_modules=["lm_head"]`), never by default, and never quantised by QLoRA. A
task whose answer tokens the frozen head ranks wrong needs it (the GRPO demo: see
`mindspeed_align.rl.cli.LORA_DEMO`)."""

MEGATRON_NAMES = {
    "linear_fc1": ("w1", "w3"),
    "linear_fc2": ("w2",),
}
"""MindSpeed-LLM's (Megatron's) feed-forward names -> ours: its fused gate/up projection is
our w1 and w3."""
