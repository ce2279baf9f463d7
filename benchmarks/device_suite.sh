#!/usr/bin/env bash
# The accelerator checks in one script, for one GPU in under 8 minutes. The figures come first,
# so that a lease cut short still brings them back:
#   1. benchmarks/attention.py: packed attention at 4k/16k/32k tokens, ours vs the previous op
#      vs SDPA (bf16, 8 query / 2 kv heads of 64);
#   2. benchmarks/train_throughput.py --shape llama-1b: training tokens/s, MFU and peak memory of
#      a Llama-3.2-1B shape at bf16, seq 4096, 8 packed documents a row, eager: ours (and with
#      the fused loss) vs transformers vs torchtitan (where installed, `pip install torchtitan`),
#      same GPU, same run;
#   3. the same, compiled: ours (`train.compile`) and torchtitan (its per-block compile);
#   4. benchmarks/generate.py on the GPU: decode tokens/s, ours vs transformers' generate;
#   5. benchmarks/host_overhead.py: the host's share of a step (no GPU work), ours vs
#      transformers, on this machine's CPU;
#   6. the CUDA tests (pytest -m gpu, every failure listed; a test module whose imports fail
#      there is reported and the rest still run), bounded by $SUITE_TEST_TIMEOUT seconds (100);
#   7. where MINDSPEED_VLLM_PYTHON names an environment with vLLM: GRPO steps with vLLM's
#      rollouts vs ours (benchmarks/grpo_throughput.py --engines native,vllm, 240 s).
# Each step has its own bound in seconds (60, 90, 120 with compilation, 45, 60, 100: at most
# 475 s with the environment's lines: under 8 minutes), times $SUITE_TIME_SCALE (1) if set.
#
#   benchmarks/device_suite.sh [--dry-run] [--out DIR]
#
# --dry-run runs the same steps on the CPU with tiny shapes (CI does, so the script cannot
# rot); the GPU tests are then only collected. Results: one JSON line per case in DIR
# (default runs/device_suite): attention.jsonl, train.jsonl, train_compiled.jsonl,
# generate.jsonl, host_overhead.jsonl, plus pytest's log, and a summary on stdout. Uses
# .venv/bin/python when there is one, else python3 with the packages' sources on PYTHONPATH
# (a bare machine with torch and transformers needs nothing installed).
set -euo pipefail
cd "$(dirname "$0")/.."

dry=0
out=runs/device_suite
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) dry=1 ;;
        --out) out="$2"; shift ;;
        -h|--help) sed -n '2,28p' "$0"; exit 0 ;;
        *) echo "device_suite.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done
mkdir -p "$out"

py=python3
[ -x .venv/bin/python ] && py=.venv/bin/python
for pkg in packages/*/src; do PYTHONPATH="$PWD/$pkg${PYTHONPATH:+:$PYTHONPATH}"; done
export PYTHONPATH PYTHONUNBUFFERED=1

if [ "$dry" = 1 ]; then
    device=cpu
    tests=(-m gpu --collect-only -q)
    test_paths=(packages/mindspeed-ops/tests)  # the step's syntax; CI imports every test file
    attention=(--seqs 512 --docs 1,8 --repeat 1 --device cpu --impls ours,sdpa)
    train=(--shape tiny --steps 1 --device cpu)
    compiled=(--shape tiny --steps 1 --device cpu --sides ours)
    decode=(--configs small --batches 1 --variants fp32 --new-tokens 8 --repeats 1 --device cpu)
    host=(--shapes tiny --steps 1 --repeat 1)
else
    device=cuda
    tests=(-m gpu -q -rfE)  # every failure listed (no -x: one would hide the rest)
    test_paths=(packages integration_tests)
    attention=(--seqs 4096,16384,32768 --docs 1,8 --repeat 3 --device cuda)
    train=(--shape llama-1b --steps 3 --device cuda)
    compiled=(--shape llama-1b --steps 3 --device cuda --sides ours,torchtitan)
    decode=(--configs headline --batches 1,32 --variants bf16 --new-tokens 64 --repeats 2
            --device cuda)
    host=(--shapes llama-1b --steps 3 --repeat 1)
fi
scale=${SUITE_TIME_SCALE:-1}
bounded() { local seconds=$1; shift; timeout "$((seconds * scale))" "$@"; }

echo "== environment"
"$py" -c "import torch, platform; print('torch', torch.__version__, '| python',
platform.python_version(), '| device', torch.cuda.get_device_name() if torch.cuda.is_available()
else 'cpu')"

# Each step runs even when the one before it failed (a lease is too short to rerun the whole
# suite); the script exits non-zero if any did.
failed=()
echo "== 1. attention (benchmarks/attention.py ${attention[*]})"
bounded 60 "$py" benchmarks/attention.py "${attention[@]}" --dtype bf16 | tee "$out/attention.jsonl" \
    || failed+=(attention)

echo "== 2. training throughput, eager (benchmarks/train_throughput.py ${train[*]})"
bounded 90 "$py" benchmarks/train_throughput.py "${train[@]}" --dtypes bf16 \
    --sides ours,ours-fused,transformers,torchtitan | tee "$out/train.jsonl" || failed+=(train)

echo "== 3. training throughput, compiled (benchmarks/train_throughput.py ${compiled[*]} --compile)"
bounded 120 "$py" benchmarks/train_throughput.py "${compiled[@]}" --dtypes bf16 --compile \
    | tee "$out/train_compiled.jsonl" || failed+=(train_compiled)

echo "== 4. decoding (benchmarks/generate.py ${decode[*]})"
bounded 45 "$py" benchmarks/generate.py "${decode[@]}" | tee "$out/generate.jsonl" \
    || failed+=(generate)

echo "== 5. host time per step (benchmarks/host_overhead.py ${host[*]})"
bounded 60 "$py" benchmarks/host_overhead.py "${host[@]}" | tee "$out/host_overhead.jsonl" \
    || failed+=(host_overhead)

echo "== 6. accelerator tests (pytest ${tests[*]})"
timeout "${SUITE_TEST_TIMEOUT:-$((100 * scale))}" "$py" -m pytest "${tests[@]}" -p no:cacheprovider \
    --continue-on-collection-errors "${test_paths[@]}" >"$out/pytest.log" 2>&1 \
    || failed+=(tests)
tail -n 25 "$out/pytest.log"

# 7. vLLM rollouts against ours (GRPO steps): only where vLLM's own environment exists
# already (the device machine has no network to create it): MINDSPEED_VLLM_PYTHON.
if [ "$dry" = 0 ] && [ -n "${MINDSPEED_VLLM_PYTHON:-}" ]; then
    echo "== 7. rollout engines (benchmarks/grpo_throughput.py --engines native,vllm)"
    bounded 240 "$py" benchmarks/grpo_throughput.py --engines native,vllm --steps 4 \
        | tee "$out/grpo_engines.jsonl" || failed+=(grpo_engines)
else
    echo "== 7. rollout engines: skipped (no MINDSPEED_VLLM_PYTHON, or a dry run)"
fi

if [ ${#failed[@]} -gt 0 ]; then
    echo "== failed on $device: ${failed[*]} (results in $out)"
    exit 1
fi
echo "== done on $device: results in $out"
