"""The memory estimator against measured runs: predicted peak per rank within 15% of the
measured one (allocator-level, `mindspeed_core.planning.measure.PeakProbe`), for layouts of
the debug Llama (one process: none / full / selective recompute / activation offload; two
processes: tp2 with sequence and loss parallel, dp_shard2, cp2, pp2) and of a ~100M Llama
(slow). Every measured and predicted number is printed (pytest -s)."""

import pytest

from mindspeed_core.planning import Job, Layout
from mindspeed_core.planning.memory import estimate_memory_per_stage
from mindspeed_core.testing import run_distributed
from mindspeed_llm.models import build_model_config
from mindspeed_llm.models.shape import model_shape
from mindspeed_tools.plan_runner import run_layout

TOLERANCE = 0.15
DEBUG = {"family": "llama", "flavor": "debug"}
# ~99M parameters: 12 x 768 blocks, 24k vocabulary
LLAMA_100M = {"family": "llama", "flavor": "debug", "hidden_size": 768, "num_layers": 12,
              "num_heads": 12, "num_kv_heads": 4, "intermediate_size": 2048,
              "vocab_size": 24576, "max_position_embeddings": 512}  # fmt: skip


def _config(spec: dict):
    spec = dict(spec)
    return build_model_config(spec.pop("family"), flavor=spec.pop("flavor"), **spec)


def _job(layout: Layout, seq_len: int) -> Job:
    microbatches = 2 if layout.pp > 1 else 1
    return Job(seq_len=seq_len, global_batch=layout.micro_batch * layout.dp * microbatches,
               device="cpu")  # fmt: skip


def _measure_layouts(spec: dict, layouts: list[Layout], seq_len: int) -> list[int]:
    """On every rank: the measured peak of each layout, one after the other."""
    return [run_layout(_config(spec), layout, _job(layout, seq_len), steps=2)["peak_bytes"]
            for layout in layouts]  # fmt: skip


def _check(spec, layouts, seq_len, measured_by_rank):
    shape = model_shape(_config(spec))
    failures = []
    for i, layout in enumerate(layouts):
        stages = estimate_memory_per_stage(shape, layout, _job(layout, seq_len))
        world = len(measured_by_rank)
        for rank, measured in enumerate(m[i] for m in measured_by_rank):
            predicted = stages[rank // (world // layout.pp)].peak
            error = predicted / measured - 1
            print(f"{layout.describe():28s} rank {rank}: measured {measured / 2**20:8.2f} MiB "
                  f"predicted {predicted / 2**20:8.2f} MiB ({error:+.1%})")  # fmt: skip
            if abs(error) > TOLERANCE:
                failures.append((layout.describe(), rank, f"{error:+.1%}"))
    assert not failures


ONE_PROCESS = [
    Layout(micro_batch=4),
    Layout(micro_batch=4, ac="full"),
    Layout(micro_batch=4, ac="selective"),
    Layout(micro_batch=4, activation_offload=True),  # on CPU the host is the device
]
TWO_PROCESSES = [
    Layout(micro_batch=4, tp=2, sequence_parallel=True, loss_parallel=True),
    Layout(micro_batch=4, dp_shard=2),
    Layout(micro_batch=4, cp=2),
    Layout(micro_batch=4, pp=2),
]


def test_memory_debug_one_process():
    _check(DEBUG, ONE_PROCESS, 128, [_measure_layouts(DEBUG, ONE_PROCESS, 128)])


@pytest.mark.distributed
@pytest.mark.slow  # tp2+sp on rank 0 varies -6%..-20% run to run (a ~1 MiB peak): not a CI gate
def test_memory_debug_two_processes():
    measured = run_distributed(_measure_layouts, 2, DEBUG, TWO_PROCESSES, 128, timeout=600)
    _check(DEBUG, TWO_PROCESSES, 128, measured)


LAYOUTS_100M = [
    Layout(micro_batch=2, dp_shard=2, ac="full"),
    Layout(micro_batch=2, tp=2, sequence_parallel=True, loss_parallel=True, ac="selective"),
    Layout(micro_batch=2, pp=2),
]


@pytest.mark.slow
@pytest.mark.distributed
def test_memory_100m_two_processes():
    measured = run_distributed(_measure_layouts, 2, LLAMA_100M, LAYOUTS_100M, 256, timeout=1800)
    _check(LLAMA_100M, LAYOUTS_100M, 256, measured)


def test_estimator_offload_and_units():
    """Offload on an accelerator moves the blocks' activations to host memory; recompute
    and tensor parallel shrink what is saved; the checks refuse a bad layout."""
    shape = model_shape(_config(LLAMA_100M))
    job = Job(seq_len=1024, global_batch=8, device="cuda")
    base = estimate_memory_per_stage(shape, Layout(micro_batch=8), job)[0]
    offload = estimate_memory_per_stage(shape, Layout(micro_batch=8, activation_offload=True), job)[0]
    assert offload.peak < base.peak and offload.host > 0.8 * base.activations - offload.activations
    full = estimate_memory_per_stage(shape, Layout(micro_batch=8, ac="full"), job)[0]
    assert full.activations < base.activations / 4
    opt = estimate_memory_per_stage(shape, Layout(dp_shard=8, micro_batch=1, optimizer_offload=True), job)[0]
    assert opt.optimizer == 0 and opt.host > 0
    cpu = Job(seq_len=1024, global_batch=8, device="cpu")
    assert (estimate_memory_per_stage(shape, Layout(micro_batch=8, activation_offload=True), cpu)[0].peak
            == estimate_memory_per_stage(shape, Layout(micro_batch=8), cpu)[0].peak)  # fmt: skip
    with pytest.raises(Exception, match="ac="):
        Layout(ac="some")


def test_expert_parallel_gathers_only_a_ranks_experts():
    """Under FSDP, a MoE block is gathered with the experts of its ep rank only: a block's
    backward holds 3/4 fewer expert bytes at ep=4 than at ep=1 (the block and the next
    gathered, its unsharded gradients and their fp32 copy), and the sharded state
    (parameters, gradients, optimizer) does not change."""
    from mindspeed_llm.models import build_model_config

    config = build_model_config("qwen3_moe", flavor="qwen3-30b-a3b")  # every block is MoE
    shape, job = model_shape(config), Job(seq_len=1024, global_batch=16, device="cuda")
    one, four = (estimate_memory_per_stage(shape, Layout(dp_shard=16, ep=ep, ac="full"), job)[0]
                 for ep in (1, 4))  # fmt: skip
    assert (one.params, one.grads, one.optimizer) == (four.params, four.grads, four.optimizer)
    experts = config.num_experts * 3 * config.hidden_size * config.moe_intermediate_size
    unit = job.element_size  # FSDP gathers in the parameter dtype
    fewer = (experts - experts // 4) * (3 * unit + 4)
    assert one.phases["block_backward"] - four.phases["block_backward"] == fewer


def test_parallelize_offload_options_refused_on_cpu():
    """The offload options of parallelize_decoder say why on a CPU-only machine."""
    from mindspeed_core.errors import ParallelError
    from mindspeed_core.parallel import ParallelDims
    from mindspeed_llm.models import get_model_spec

    spec = get_model_spec("llama")
    dims = ParallelDims().build()
    with pytest.raises(ParallelError, match="already on the CPU"):
        spec.parallelize(spec.build(_config(DEBUG)), dims, activation_offload=True)
    with pytest.raises(ParallelError, match="needs FSDP"):
        spec.parallelize(spec.build(_config(DEBUG)), dims, cpu_offload=True)
