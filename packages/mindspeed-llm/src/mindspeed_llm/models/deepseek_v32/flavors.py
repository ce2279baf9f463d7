"""DeepSeek-V3.2 sizes: DeepSeek-V3's with the indexer (deepseek-ai/DeepSeek-V3.2-Exp's
config.json: 64 indexer heads of 128, top 2048 keys)."""

from dataclasses import replace

from mindspeed_llm.models.deepseek_v3.flavors import FLAVORS as V3

FLAVORS = {
    # the debug V3 with an 8-key selection, so that 16-token rows already attend sparsely
    "debug": replace(V3["debug"], family="deepseek_v32", index_topk=8, index_n_heads=2,
                     index_head_dim=16, num_nextn_predict_layers=0),  # fmt: skip
    "deepseek-v3.2": replace(V3["deepseek-v3"], family="deepseek_v32", index_topk=2048,
                             index_n_heads=64, index_head_dim=128),  # fmt: skip
}
