"""`checkpoint.saved`: padding rows are cut off on the way out and come back as zeros on
the way in; a copy's optimizer state is saved under the weight's name and restored to it."""

import torch
from torch import nn

from mindspeed_core.checkpoint.saved import (
    SavedParam,
    optimizer_key,
    restored_state,
    saved_params,
    saved_state,
)


class Padded(nn.Module):
    """An embedding of 5 real rows padded to 8, and a copy of it (a pipeline stage's)."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.arange(16.0).view(8, 2))
        self.copy = nn.Parameter(torch.zeros(8, 2))

    def saved_params(self):
        return {
            "table": SavedParam("table", 5),
            "copy": SavedParam("table", 5, optimizer_only=True),
        }


def test_padding_is_cut_on_save_and_zero_on_load():
    model = Padded()
    assert set(saved_params(model)) == {"table"}  # the copy is renamed in the optimizer only
    out = saved_state(dict(model.named_parameters()), saved_params(model))
    assert out["table"].shape == (5, 2) and torch.equal(out["table"], model.table[:5])
    like = dict(model.named_parameters())
    back = restored_state({"table": out["table"] + 1}, saved_params(model), like)
    assert torch.equal(back["table"][:5], model.table[:5] + 1) and not back["table"][5:].any()


def test_a_copys_optimizer_state_goes_under_the_weights_name_and_back():
    model = Padded()
    params = saved_params(model, optimizer=True)
    state = {"state.copy.exp_avg": torch.ones(8, 2), "param_groups.copy.lr": 0.1}
    out = saved_state(state, params, optimizer_key)
    assert set(out) == {"state.table.exp_avg", "param_groups.table.lr"}
    assert out["state.table.exp_avg"].shape == (5, 2)
    like = {"copy": model.copy}  # a stage that holds only the copy
    back = restored_state(out, {"copy": params["copy"]}, like, optimizer_key)
    assert set(back) == {"state.copy.exp_avg", "param_groups.copy.lr"}
    assert back["state.copy.exp_avg"].shape == (8, 2) and back["param_groups.copy.lr"] == 0.1
    assert back["state.copy.exp_avg"][:5].all() and not back["state.copy.exp_avg"][5:].any()
