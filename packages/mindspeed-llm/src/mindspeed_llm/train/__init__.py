"""Training: the pretraining configuration (`config`), loop (`trainer`), data order
(`loader`) and loss plot (`plots`). Import the submodules you need."""
