"""The training engine every trainer shares, and pretraining's pieces.

`build` (model on its layout, optimizer, checkpoint states), `step` (one optimizer step),
`loop` (metrics, validation, checkpoints, resume), `objectives` (what is optimised),
`run_dir` (the run directory), `trainer` (a config + a data source + an objective);
pretraining's `config`, `pretrain_data`, `loader` (resumable sampler) and `plots`.
Import the submodules you need.
"""
