"""Every family's blocks compile as one graph (`fullgraph=True`) on CPU under packed documents
and train as they do eager: fp32, the losses and every gradient of two steps within 1e-5; then
five steps with five different document counts compile no block again (`cu_seqlens`' length
is symbolic: `apply_compile(varying=...)`). A family that cannot compile is refused by
`resolve_compile` with its reason in one log line and runs eager. CI runs Llama; the sweep
over every family (MoE routing, MLA, DeepSeek sparse attention, sinks, windows) is slow."""

import copy
import logging

import pytest
import torch
from torch._dynamo.utils import counters

import mindspeed_ops
from mindspeed_core.parallel import apply_compile
from mindspeed_llm.models import build_model_config, get_model_spec
from mindspeed_llm.models.registry import _REGISTRY
from mindspeed_llm.train.compile import compile_blocker, resolve_compile

ROWS, SEQ = 2, 24
FAMILIES = sorted(_REGISTRY)


def _batch(step: int, docs: int, vocab: int):
    """(tokens, labels, positions, cu_seqlens) of ROWS rows, each cut into `docs` documents."""
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, vocab, (ROWS, SEQ + 1), generator=g)
    cuts = sorted(torch.randperm(SEQ - 1, generator=g)[: docs - 1].add(1).tolist())
    row = [0, *cuts, SEQ]
    bounds = [r * SEQ + b for r in range(ROWS) for b in row[:-1]] + [ROWS * SEQ]
    cu_seqlens = torch.tensor(bounds, dtype=torch.int32)
    positions = mindspeed_ops.position_ids_from_cu_seqlens(cu_seqlens).view(ROWS, SEQ)
    return tokens[:, :-1], tokens[:, 1:], positions, cu_seqlens


def _train(model, batches):
    """Losses and gradients of one SGD step per batch."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    losses, grads = [], []
    for tokens, labels, positions, cu_seqlens in batches:
        logits = model(tokens, position_ids=positions, cu_seqlens=cu_seqlens)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        optimizer.step()
        optimizer.zero_grad()
    return losses, grads


def _check(family: str) -> None:
    config = build_model_config(family, flavor="debug", ops_impl="auto")
    if compile_blocker(config) is not None:
        assert not resolve_compile("on", torch.device("cpu"), config)
        return
    torch._dynamo.reset()  # a fresh cache: one model per process, as in a run
    torch.manual_seed(0)
    eager = get_model_spec(family).build(config)
    compiled = apply_compile(copy.deepcopy(eager), fullgraph=True, varying={"cu_seqlens": 0})
    batches = [_batch(step, docs, config.vocab_size) for step, docs in enumerate((2, 3))]
    counters.clear()
    expected, first = _train(eager, batches), _train(compiled, batches[:1])
    graphs = counters["stats"]["unique_graphs"]  # what the first step compiled
    assert graphs >= 1
    second = _train(compiled, batches[1:])  # another document count
    losses, all_grads = first[0] + second[0], first[1] + second[1]
    assert not counters["graph_break"], dict(counters["graph_break"])
    pairs = zip(losses, all_grads, *expected, strict=True)
    for loss, grads, ref_loss, ref_grads in pairs:
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
        assert grads.keys() == ref_grads.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(grad, ref_grads[name], rtol=1e-5, atol=1e-5, msg=name)
    more = [_batch(10 + docs, docs, config.vocab_size) for docs in (1, 4, 5, 6, 7)]
    _train(compiled, more)  # five more document counts: nothing compiles again
    assert counters["stats"]["unique_graphs"] == graphs
    assert not counters["graph_break"]


def test_llama_blocks_compile_as_eager_without_recompiling():
    _check("llama")


@pytest.mark.slow
@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "llama"])
def test_every_family_compiles_as_eager_or_says_why_not(family):
    _check(family)


def test_a_model_that_cannot_compile_says_why_in_one_line(caplog):
    config = build_model_config("qwen3_next", flavor="debug")
    with caplog.at_level(logging.WARNING, logger="mindspeed.train"):
        assert not resolve_compile("on", torch.device("cpu"), config)
    (line,) = caplog.messages
    assert "qwen3_next blocks run eager" in line and "delta rule" in line
    llama = build_model_config("llama", flavor="debug")
    assert resolve_compile("auto", torch.device("cuda"), llama)  # nothing is compiled here
    assert not resolve_compile("auto", torch.device("cpu"), llama)
    assert not resolve_compile("off", torch.device("cuda"), llama)


def test_cuda_graphs_are_refused_where_none_can_be_recorded(tmp_path, capsys, monkeypatch):
    """`train.cuda_graphs`: one line naming the field, exit 2, no run folder; and `train.compile`
    values other than auto/on/off (or a bool) the same."""
    from mindspeed_core.cli import guarded
    from mindspeed_llm.pretrain import main
    from mindspeed_llm.train.compile import compile_mode

    monkeypatch.setenv("MINDSPEED_CACHE", str(tmp_path / "cache"))
    run_dir = tmp_path / "run"
    common = ["--train.steps=1", "--optim.warmup_steps=0", "--data.seq_len=32", f"--logging.run_dir={run_dir}",
              "--logging.progress=false"]  # fmt: skip
    cases = [
        (["--train.cuda_graphs=true"], "train.cuda_graphs=true needs a CUDA device; this run's is cpu"),
        (["--train.compile=sometimes"], "train.compile"),
    ]  # fmt: skip
    for extra, message in cases:
        capsys.readouterr()
        assert guarded(main, [*common, *extra]) == 2
        line = capsys.readouterr().err.strip().splitlines()[-1]
        assert line.startswith("error: ") and message in line, line
        assert not (run_dir / "checkpoints").exists()
    llama = build_model_config("llama", flavor="debug")
    cuda = torch.device("cuda")  # nothing runs on it: the decision only
    with pytest.raises(Exception, match="replays the compiled blocks: set train.compile auto or on"):
        compile_mode("off", True, cuda, llama)
    with pytest.raises(Exception, match="qwen3_next blocks do not compile: .*delta rule"):
        compile_mode("on", True, cuda, build_model_config("qwen3_next", flavor="debug"))
    assert compile_mode("auto", True, cuda, llama) == "reduce-overhead"
    assert compile_mode("auto", False, cuda, llama) == "default"
    assert compile_mode("auto", False, torch.device("cpu"), llama) is None
