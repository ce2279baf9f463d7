"""On an NVIDIA GPU (skipped elsewhere): parity with transformers through the CUDA backends
of the ops (SDPA attention, liger/composed norms), and a bf16 training step."""

import pytest
import torch

from mindspeed_core.testing import import_sibling, requires_device
from mindspeed_llm.models import Transformer, build_model_config

models_hf = import_sibling(__file__, "models_hf")
pytestmark = [pytest.mark.gpu, requires_device("cuda")]
ATOL = 1e-4  # fp32 on GPU: different kernels and reduction orders than transformers' eager


@pytest.fixture(autouse=True)
def no_tf32():
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn


@pytest.mark.parametrize("case", list(models_hf.CASES))
def test_logits_match_transformers_on_cuda(case):
    hf = models_hf.make_hf(case, device="cuda")
    ours = models_hf.ours_from(hf)
    ids = models_hf.tokens().cuda()
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf(ids).logits, atol=ATOL, rtol=0)


def test_packed_bf16_step_on_cuda():
    config = build_model_config("qwen3", flavor="debug")
    model = Transformer(config).cuda().to(torch.bfloat16)
    ids = models_hf.tokens().cuda()
    cu_seqlens = torch.tensor([0, 10, 24, 48], dtype=torch.int32, device="cuda")
    logits = model(ids, cu_seqlens=cu_seqlens)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), ids.flatten())
    loss.backward()
    assert torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_compiled_blocks_and_cuda_graphs_train_as_eager_on_cuda(mode):
    """`train.compile` (each block one graph) and `train.cuda_graphs` (reduce-overhead: the
    blocks replayed as CUDA graphs) on packed documents of changing counts: eager's losses."""
    import copy

    from mindspeed_core.parallel import apply_compile

    config = build_model_config("llama", flavor="debug")
    torch.manual_seed(0)
    eager = Transformer(config).cuda()
    compiled = apply_compile(copy.deepcopy(eager), varying={"cu_seqlens": 0}, mode=mode)
    losses = {}
    for name, model in (("eager", eager), ("compiled", compiled)):
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        losses[name] = []
        for step, bounds in enumerate(([0, 10, 24, 48], [0, 5, 24, 30, 48], [0, 10, 24, 48])):
            ids = models_hf.tokens(seed=step).cuda()
            cu_seqlens = torch.tensor(bounds, dtype=torch.int32, device="cuda")
            logits = model(ids, cu_seqlens=cu_seqlens)
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), ids.flatten())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses[name].append(float(loss))
    assert losses["compiled"] == pytest.approx(losses["eager"], rel=1e-4, abs=1e-4)
