"""The whole life of a model through the CLI, each stage starting from the last one's output:
pretrain demo -> convert -> sft -> convert -> dpo -> grpo -> eval -> convert to Hugging Face,
where transformers loads the model and generates the greedy tokens `mindspeed generate` does.

Each stage must also have done its job on its own terms (loss down, preference margin up,
rollouts scored), so a stage that silently trained nothing fails here.
"""

import json
import random

import pytest

from mindspeed_core.training import read_metrics

pytestmark = pytest.mark.slow
QUIET = ["--logging.progress=false", "--logging.tensorboard=false"]
CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"  # what chatml renders


def _write_task(folder):
    """Addition of two digits as SFT records, preference pairs and RL prompts (chatml)."""
    rng = random.Random(0)
    draw = [(rng.randint(0, 9), rng.randint(0, 9)) for _ in range(664)]
    sft = [{"instruction": f"add {a} and {b}", "output": str(a + b)} for a, b in draw[:400]]
    pairs = [{"prompt": f"add {a} and {b}", "chosen": str(a + b), "rejected": str(a + b + 1)}
             for a, b in draw[400:600]]  # fmt: skip
    prompts = [{"prompt": CHAT.format(f"add {a} and {b}"), "answer": str(a + b)}
               for a, b in draw[600:]]  # fmt: skip
    for name, rows in (("sft", sft), ("pairs", pairs), ("prompts", prompts)):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def _ok(done):
    assert done.returncode == 0, done.stderr[-4000:]
    return done


def test_pretrain_sft_dpo_grpo_eval_convert_generate(mindspeed, tmp_path):
    _write_task(tmp_path)
    run = {name: tmp_path / name for name in ("pre", "sft", "dpo", "grpo")}
    _ok(mindspeed("pretrain", "--train.steps=60", f"--logging.run_dir={run['pre']}", *QUIET))
    pre = read_metrics(run["pre"] / "metrics.jsonl")
    assert pre[-1]["loss"] < pre[0]["loss"] / 2

    _ok(mindspeed("convert", "--input", run["pre"] / "checkpoints", "--output", tmp_path / "hf0", "--to", "hf"))  # fmt: skip
    _ok(mindspeed("sft", f"--model.hf_path={tmp_path / 'hf0'}", f"--data.paths=[{tmp_path / 'sft.jsonl'}]",
                  "--data.chat_template=chatml", "--train.steps=150", f"--logging.run_dir={run['sft']}", *QUIET))  # fmt: skip
    sft = read_metrics(run["sft"] / "metrics.jsonl")
    assert sft[-1]["loss"] < sft[0]["loss"] / 5

    _ok(mindspeed("convert", "--input", run["sft"] / "checkpoints", "--output", tmp_path / "hf1", "--to", "hf"))  # fmt: skip
    _ok(mindspeed("dpo", f"--model.hf_path={tmp_path / 'hf1'}", f"--data.paths=[{tmp_path / 'pairs.jsonl'}]",
                  "--data.chat_template=chatml", "--train.steps=30", f"--logging.run_dir={run['dpo']}", *QUIET))  # fmt: skip
    dpo = read_metrics(run["dpo"] / "metrics.jsonl")
    assert dpo[-1]["rewards/margins"] > dpo[0]["rewards/margins"] > 0

    # grpo starts from the dpo run's own checkpoints (and finds their tokenizer)
    _ok(mindspeed("grpo", f"--grpo.init_from={run['dpo'] / 'checkpoints'}", f"--data.prompts={tmp_path / 'prompts.jsonl'}",
                  "--data.eval_prompts=16", "--train.steps=5", f"--logging.run_dir={run['grpo']}", *QUIET))  # fmt: skip
    grpo = read_metrics(run["grpo"] / "metrics.jsonl")
    assert grpo and all(0 <= r["reward/mean"] <= 1 for r in grpo if "reward/mean" in r)
    assert any("reward/mean" in r for r in grpo)

    out = tmp_path / "eval"
    _ok(mindspeed("eval", "--model", run["grpo"] / "checkpoints", "--output", out, "--no-progress"))  # fmt: skip
    results = json.loads((out / "demo_results.json").read_text())
    assert len(results["items"]) == 120 and 0 <= results["metrics"]["accuracy"] <= 1

    hf = tmp_path / "hf_final"
    _ok(mindspeed("convert", "--input", run["grpo"] / "checkpoints", "--output", hf, "--to", "hf"))  # fmt: skip
    prompt = CHAT.format("add 3 and 4")
    ours = {}
    for model in (hf, run["grpo"] / "checkpoints"):
        done = _ok(mindspeed("generate", "--model", model, "--max-new-tokens", "8", prompt))
        ours[model] = json.loads(done.stdout)["token_ids"]
    assert ours[hf] == ours[run["grpo"] / "checkpoints"]
    assert _transformers_greedy(hf, prompt, 8) == ours[hf]


def _transformers_greedy(folder, prompt: str, new_tokens: int) -> list[int]:
    """transformers' own greedy `generate` on the exported folder (prompt ids as ours)."""
    import torch
    import transformers

    from mindspeed_llm.generation.text import Generator
    from mindspeed_llm.tokenizer import load_tokenizer

    ids = Generator(None, load_tokenizer(folder)).encode(prompt)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0)  # fmt: skip
    return out[0, len(ids) :].tolist()
