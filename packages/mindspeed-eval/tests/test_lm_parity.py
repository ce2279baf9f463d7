"""`MindSpeedLM` against lm-eval's own Hugging Face backend (HFLM) on the same tiny random
Llama folder: the same token ids, per-item log-likelihoods (1e-4) and is_greedy on a
local multiple-choice task run through `simple_evaluate`, rolling log-likelihoods of a
document longer than max_length, and greedy generations with stop strings."""

import json
import math
import re
from pathlib import Path

import pytest
import torch

from mindspeed_core.testing import import_sibling

helpers = import_sibling(__file__, "eval_helpers")
lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("transformers")

DOCS = [
    {"question": "What is seven plus one", "choices": ["eight", "nine", "seven"], "answer": 0},
    {
        "question": "Which is red",
        "choices": ["the apple", "the river water", "a stone"],
        "answer": 0,
    },
    {"question": "Is fire cold", "choices": ["yes", "no"], "answer": 1},
    {"question": "The capital of the old country", "choices": ["a city", "a king"], "answer": 0},
    {"question": "", "choices": [" The queen", " Water"], "answer": 1},  # empty context
]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lm-parity")
    model_dir = helpers.make_model_dir(root / "model")
    data = root / "mc.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    task = {
        "task": "mindspeed_test_mc",
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data)}},
        "test_split": "test",
        "output_type": "multiple_choice",
        "doc_to_text": "{{question}}",
        "doc_to_choice": "{{choices}}",
        "doc_to_target": "{{answer}}",
        "target_delimiter": " ",
        "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
    }
    return model_dir, task


def _hflm(model_dir, **kwargs):
    from lm_eval.models.huggingface import HFLM

    return HFLM(pretrained=str(model_dir), device="cpu", dtype="float32", batch_size=3, **kwargs)


def _loglikelihoods(result):
    samples = result["samples"]["mindspeed_test_mc"]
    return {s["doc_id"]: s["resps"] for s in sorted(samples, key=lambda s: s["doc_id"])}


def test_loglikelihood_tokens_and_generation_equal_hflm(setup, monkeypatch):
    from lm_eval.api.instance import Instance

    import mindspeed_eval.lm  # noqa: F401  (registers "mindspeed")

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model_dir, task = setup
    hf = _hflm(model_dir)
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_defaults=False)  # dict tasks: no need to index the built-ins
    kwargs = {"tasks": [task], "log_samples": True, "random_seed": 0, "task_manager": manager}
    ours_result = lm_eval.simple_evaluate(
        # HFLM's own spellings, as lm-eval users type them
        model="mindspeed", model_args=f"pretrained={model_dir},dtype=float32,batch_size=2", **kwargs
    )
    hf_result = lm_eval.simple_evaluate(model=hf, **kwargs)
    ours = mindspeed_eval.lm.MindSpeedLM(model=str(model_dir), batch_size=2)

    # token ids first: every context and context + continuation of the task
    for doc in DOCS:
        for choice in doc["choices"]:
            for text in (doc["question"], doc["question"] + " " + choice, choice):
                assert ours.tok_encode(text) == hf.tok_encode(text), text
    assert ours.tok_encode("<s>Water") == hf.tok_encode("<s>Water")  # no second BOS

    got, expected = _loglikelihoods(ours_result), _loglikelihoods(hf_result)
    assert got.keys() == expected.keys() == set(range(len(DOCS)))
    for doc_id, responses in expected.items():
        for (ours_ll, ours_greedy), (hf_ll, hf_greedy) in zip(
            (r[0] for r in got[doc_id]), (r[0] for r in responses), strict=True
        ):
            assert math.isclose(float(ours_ll), float(hf_ll), abs_tol=1e-4), doc_id
            assert ours_greedy == hf_greedy, doc_id
    acc = "acc,none"
    assert (
        ours_result["results"]["mindspeed_test_mc"][acc]
        == hf_result["results"]["mindspeed_test_mc"][acc]
    )

    # a document longer than max_length, scored in rolling windows
    short_ours = mindspeed_eval.lm.MindSpeedLM(model=str(model_dir), max_length=16, batch_size=3)
    short_hf = _hflm(model_dir, max_length=16)
    text = " ".join(helpers.corpus(6, seed=3))
    assert len(short_ours.tok_encode(text)) > 3 * 16
    rolling = [
        Instance("loglikelihood_rolling", {}, (t,), i) for i, t in enumerate([text, "Seven."])
    ]
    for a, b in zip(
        short_ours.loglikelihood_rolling(rolling),
        short_hf.loglikelihood_rolling(rolling),
        strict=True,
    ):
        assert math.isclose(a, b, abs_tol=1e-4)

    # greedy generation with stop strings (a batch of different lengths)
    gen_kwargs = {"until": [".", " the"], "max_gen_toks": 12, "do_sample": False}
    prompts = ["The king is", "What is seven plus one? Answer:", "Water"]
    requests = [
        Instance("generate_until", {}, (p, dict(gen_kwargs)), i) for i, p in enumerate(prompts)
    ]
    generated = ours.generate_until(requests)
    assert generated == hf.generate_until(requests)
    assert any(generated)  # something to compare


@pytest.mark.slow
def test_scoring_never_imports_transformers(setup):
    """The scorer behind MindSpeedLM imports no transformers (a subprocess checks)."""
    import subprocess
    import sys

    model_dir, _ = setup
    code = (
        "import sys; from mindspeed_eval.loading import load_for_eval; "
        "from mindspeed_eval.scorer import Scorer; "
        f"s = Scorer(load_for_eval({str(model_dir)!r})); "
        "s.loglikelihood([('The king', ' is old')]); s.generate_until(['Water'], max_gen_toks=2); "
        "print('transformers' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "False"


def test_model_args_reach_the_scorer(setup):
    import mindspeed_eval.lm

    model_dir, _ = setup
    lm = mindspeed_eval.lm.MindSpeedLM.create_from_arg_string(
        f"model={model_dir},batch_size=5,max_length=64,add_bos_token=False,max_gen_toks=7"
    )
    assert (lm.batch_size, lm.max_length, lm.max_gen_toks) == (5, 64, 7)
    assert lm.tok_encode("Water")[0] != 0  # no BOS
    assert (
        lm.apply_chat_template([{"role": "user", "content": "hi"}]) == "<s>user: hi\n<s>assistant:"
    )
    assert Path(lm.tokenizer_name.replace("__", "/")).name == "tokenizer.json"
    # lm-eval's command line adds device="cuda:0" and batch_size: a missing device means auto
    lm = mindspeed_eval.lm.MindSpeedLM.create_from_arg_string(
        f"model={model_dir}", {"device": "cuda:0", "batch_size": 3}
    )
    assert lm.batch_size == 3 and lm.device.type in ("cpu", "cuda")
    # HFLM's spellings: pretrained=, dtype=bfloat16, batch_size=auto; trust_remote_code refused
    lm = mindspeed_eval.lm.MindSpeedLM.create_from_arg_string(
        f"pretrained={model_dir},dtype=bfloat16,batch_size=auto,trust_remote_code=False"
    )
    assert next(lm.scorer.model.parameters()).dtype == torch.bfloat16 and lm.batch_size == 8
    refused = {
        f"pretrained={model_dir},trust_remote_code=True": "trust_remote_code=True: a MindSpeed",
        f"pretrained={model_dir},model=/elsewhere": "name two models",
        f"pretrained={model_dir},dtype=float64": "dtype 'float64' is not one of auto, fp32",
        "batch_size=2": "needs model=DIR (or pretrained=DIR",
    }
    for args, message in refused.items():
        with pytest.raises(Exception, match=re.escape(message)):
            mindspeed_eval.lm.MindSpeedLM.create_from_arg_string(args)


@pytest.mark.slow
def test_mindspeed_lm_eval_command_line(setup, tmp_path):
    """`mindspeed-lm-eval --model mindspeed` is lm-eval's command line with ours registered."""
    import os
    import subprocess
    import sys

    model_dir, task = setup
    (tmp_path / "task.yaml").write_text(json.dumps(task))  # JSON is YAML
    script = Path(sys.executable).with_name("mindspeed-lm-eval")
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    argv = [str(script), "--model", "mindspeed", "--model_args", f"model={model_dir}"]
    argv += ["--tasks", "mindspeed_test_mc", "--include_path", str(tmp_path)]
    out = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "mindspeed_test_mc" in out.stdout and "acc" in out.stdout
