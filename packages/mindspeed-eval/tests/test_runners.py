"""`mindspeed eval` runners on local files made here, through the CLI: MMLU's accuracy and
per-item log-likelihoods equal lm-eval's Hugging Face backend on the same CSVs (through
the task configs of `lmeval_tasks`); each other layout is read and graded; bad input is
one line with exit 2."""

import json
import math
from pathlib import Path

import pytest

from mindspeed_core.cli import run as cli
from mindspeed_core.testing import import_sibling

helpers = import_sibling(__file__, "eval_helpers")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return helpers.make_model_dir(tmp_path_factory.mktemp("runners") / "model")


def _results(folder: Path, task: str) -> dict:
    return json.loads((folder / f"{task}_results.json").read_text())


def test_mmlu_accuracy_equals_lm_eval_hf_backend(model_dir, tmp_path, monkeypatch, capsys):
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.models.huggingface import HFLM

    from mindspeed_eval.lmeval_tasks import mmlu_task_configs

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    data = helpers.write_mmlu(tmp_path / "mmlu", num_test=8, num_dev=3)
    out = tmp_path / "out"
    argv = ["eval", "--model", str(model_dir), "--task", "mmlu", "--data", str(data)]
    assert cli([*argv, "--shots", "2", "--output", str(out), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    ours = _results(out, "mmlu")
    assert "anatomy" in printed and f"{ours['metrics']['accuracy']:.4f}" in printed
    assert (out / "mmlu_summary.md").read_text().startswith("# mmlu (ppl)")

    hf = HFLM(pretrained=str(model_dir), device="cpu", dtype="float32", batch_size=4)
    configs = mmlu_task_configs(data, shots=2)
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_defaults=False)  # dict tasks: no need to index the built-ins
    theirs = lm_eval.simple_evaluate(
        model=hf, tasks=configs, log_samples=True, task_manager=manager
    )
    for subject, row in ours["subjects"].items():
        assert row["accuracy"] == theirs["results"][f"mindspeed_mmlu_{subject}"]["acc,none"]
    items = [i for i in ours["items"] if i["subject"] == "anatomy"]
    samples = sorted(theirs["samples"]["mindspeed_mmlu_anatomy"], key=lambda s: s["doc_id"])
    assert len(items) == len(samples) == 8
    for item, sample in zip(items, samples, strict=True):
        for ll, resp in zip(item["loglikelihoods"], sample["resps"], strict=True):
            assert math.isclose(ll, float(resp[0][0]), abs_tol=1e-4)


def _write_layouts(root: Path) -> dict[str, Path]:
    """One tiny folder per other benchmark, in MindSpeed-LLM's layouts."""
    paths = {
        name: root / name for name in ("ceval", "boolq", "bbh", "agieval", "gsm8k", "humaneval")
    }
    for path in paths.values():
        path.mkdir(parents=True)
    for split in ("val", "dev"):
        (paths["ceval"] / split).mkdir()
        rows = ["id,question,A,B,C,D,answer,explanation"]
        rows += [f"{i},问题 {i} 是什么,甲,乙,丙,丁,{'ABCD'[i % 4]}," for i in range(4)]
        (paths["ceval"] / split / f"law_{split}.csv").write_text("\n".join(rows) + "\n")
    boolq = [
        {"question": "is water wet", "passage": "Water is wet.", "answer": i % 2 == 0}
        for i in range(4)
    ]
    (paths["boolq"] / "dev.jsonl").write_text("".join(json.dumps(r) + "\n" for r in boolq))
    bbh = {
        "examples": [
            {"input": "not ( True ) is", "target": "False"},
            {"input": "True is", "target": "True"},
        ]
    }
    (paths["bbh"] / "boolean_expressions.json").write_text(json.dumps(bbh))
    agi = [{"passage": None, "question": "Which is red?", "options": ["(A)sky", "(B)apple"], "label": "B"},
           {"passage": "", "question": "Which two?", "options": ["(A)x", "(B)y", "(C)z"], "label": ["A", "C"]}]  # fmt: skip
    (paths["agieval"] / "sat-en.jsonl").write_text("".join(json.dumps(r) + "\n" for r in agi))
    gsm = [{"question": "What is 2 plus 3?", "answer": "2 + 3 = 5\n#### 5"}]
    for name in ("test.jsonl", "train.jsonl"):
        (paths["gsm8k"] / name).write_text(json.dumps(gsm[0]) + "\n")
    task = {"task_id": "t/0", "prompt": "def add(a, b):\n", "entry_point": "add",
            "test": "def check(f):\n    assert f(1, 2) == 3\n"}  # fmt: skip
    (paths["humaneval"] / "he.jsonl").write_text(json.dumps(task) + "\n")
    return paths


def test_each_layout_is_read_and_graded(model_dir, tmp_path, capsys):
    from mindspeed_eval.loading import load_for_eval
    from mindspeed_eval.scorer import Scorer

    paths = _write_layouts(tmp_path / "data")
    out = tmp_path / "out"
    base = ["eval", "--model", str(model_dir), "--output", str(out), "--no-progress"]
    base += ["--max-gen-toks", "12"]  # a random model rarely stops by itself
    expected_items = {"ceval": 4, "boolq": 4, "bbh": 2, "agieval": 2, "gsm8k": 1, "humaneval": 1}
    for task, path in paths.items():
        extra = ["--allow-code-execution", "--samples", "2"] if task == "humaneval" else []
        assert cli([*base, "--task", task, "--data", str(path), *extra]) == 0, task
        result = _results(out, task)
        assert len(result["items"]) == expected_items[task] * (2 if task == "humaneval" else 1)
    capsys.readouterr()
    # ppl answers are the most likely choice of our own scorer
    scorer = Scorer(load_for_eval(model_dir))
    for item in _results(out, "boolq")["items"]:
        assert (
            item["answer"] == ("Yes", "No")[max(range(2), key=item["loglikelihoods"].__getitem__)]
        )
    prompt = "Water is wet.\nQuestion: is water wet?\nAnswer:"
    lls = [ll for ll, _ in scorer.loglikelihood([(prompt, " Yes"), (prompt, " No")])]
    assert _results(out, "boolq")["items"][0]["loglikelihoods"] == pytest.approx(lls, abs=1e-5)
    agieval = _results(out, "agieval")["items"]
    assert "loglikelihoods" in agieval[0] and "output" in agieval[1]  # multi-label: generated
    assert set(_results(out, "humaneval")["metrics"]) == {"accuracy", "pass@1"}


def _one_line_error(capsys, argv) -> str:
    assert cli(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: ")
    return err


def test_bad_input_is_one_line_and_exit_2(model_dir, tmp_path, capsys):
    data = helpers.write_mmlu(tmp_path / "mmlu", subjects=("anatomy",))
    broken = data / "test" / "anatomy_test.csv"
    broken.write_text(broken.read_text() + "just,four,columns,here\n")
    argv = ["eval", "--model", str(model_dir), "--task", "mmlu", "--data", str(data)]
    err = _one_line_error(capsys, argv)
    assert str(broken) in err and "expected 6 columns" in err
    broken.write_bytes(broken.read_bytes()[:-23] + "caf\u00e9,b,c,d,e,A\n".encode("latin-1"))
    err = _one_line_error(capsys, argv)
    assert f"{broken}:" in err and "not UTF-8 text (byte 0xe9 at column 4)" in err, err
    err = _one_line_error(
        capsys, [*argv[:3], "--task", "mmlu", "--data", str(tmp_path / "boolq_like")]
    )
    assert "does not exist" in err
    (tmp_path / "flat").mkdir()
    (tmp_path / "flat" / "x.jsonl").write_text("{}\n")
    err = _one_line_error(capsys, [*argv[:3], "--task", "mmlu", "--data", str(tmp_path / "flat")])
    assert "_test.csv" in err and "expects" in err
    err = _one_line_error(capsys, [*argv[:3], "--task", "mmlu-pro", "--data", str(data)])
    assert "unknown task 'mmlu-pro'" in err
    assert all(
        name in err for name in ("mmlu", "ceval", "boolq", "bbh", "agieval", "gsm8k", "humaneval")
    )
    err = _one_line_error(capsys, ["eval", "--model", str(tmp_path / "flat"), "--task", "demo"])
    assert str(tmp_path / "flat") in err and "config.json" in err
    err = _one_line_error(
        capsys, ["eval", "--model", str(model_dir), "--task", "humaneval", "--data", str(tmp_path)]
    )
    assert "--allow-code-execution" in err


def test_values_that_would_score_wrongly_are_refused_before_scoring(model_dir, tmp_path, capsys):
    data = helpers.write_mmlu(tmp_path / "mmlu", subjects=("anatomy",))
    argv = ["eval", "--model", str(model_dir), "--task", "mmlu", "--data", str(data)]
    for extra, expected in (
        (["--limit", "-1"], "--limit must be >= 1, got -1"),  # would score n-1 items
        (["--shots", "-3"], "--shots must be >= 0, got -3"),  # would run "-3-shot"
        (["--temperature", "nan"], "--temperature must be a finite number >= 0, got nan"),
    ):
        assert expected in _one_line_error(capsys, [*argv, *extra])
    taken = tmp_path / "taken"
    taken.write_text("a file")
    err = _one_line_error(capsys, [*argv, "--output", str(taken)])  # before the scoring, now
    assert f"--output {taken} is a file, not a folder" in err
    empty = tmp_path / "empty"
    (empty / "test").mkdir(parents=True)
    (empty / "test" / "anatomy_test.csv").write_text("")
    err = _one_line_error(capsys, [*argv[:5], "--data", str(empty)])  # was accuracy 0.0 of 0
    assert f"--data {empty}: no mmlu items in it" in err


def test_lm_eval_passthrough_runs_a_local_task_yaml(model_dir, tmp_path, capsys):
    pytest.importorskip("lm_eval")
    docs = [{"question": "Is fire cold", "choices": ["yes", "no"], "answer": 1}] * 3
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    yaml_dir = tmp_path / "tasks"
    yaml_dir.mkdir()
    (yaml_dir / "local_yes_no.yaml").write_text(
        "task: local_yes_no\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {tmp_path / 'docs.jsonl'}\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: '{{question}}?'\n"
        "doc_to_choice: '{{choices}}'\ndoc_to_target: '{{answer}}'\n"
        "metric_list:\n  - metric: acc\n"
    )
    out = tmp_path / "out"
    base = ["eval", "--model", str(model_dir), "--data", str(yaml_dir), "--output", str(out)]
    assert cli([*base, "--task", "lm-eval:local_yes_no", "--no-progress"]) == 0
    assert "local_yes_no" in capsys.readouterr().out
    result = json.loads((out / "lm-eval_local_yes_no_results.json").read_text())
    assert result["results"]["local_yes_no"]["acc,none"] in (0.0, 1.0)  # one doc, thrice
    err = _one_line_error(capsys, [*base, "--task", "lm-eval:no_such_task_here"])
    assert "no_such_task_here" in err


def test_converted_checkpoint_scores_like_its_hf_folder(model_dir, tmp_path):
    from mindspeed_eval.loading import load_for_eval
    from mindspeed_eval.scorer import Scorer
    from mindspeed_tools.convert import hf_to_mindspeed

    converted = hf_to_mindspeed(model_dir, tmp_path / "converted")
    pairs = [("The king is", " old"), ("", "Water is blue")]
    hf = Scorer(load_for_eval(model_dir)).loglikelihood(pairs)
    ours = Scorer(load_for_eval(converted)).loglikelihood(pairs)
    assert ours == hf


def test_needle_haystacks_hold_the_fact_at_its_depth_and_fit_their_length():
    from mindspeed_eval.runner import summarise
    from mindspeed_eval.tasks.needle import QUESTION, NeedleTask

    task = NeedleTask([64, 200], [0, 50, 100], per_cell=2)  # lengths counted in words here
    items = task.load(None, shots=0, fewshot=None)
    assert len(items) == 2 * 3 * 2
    for item in items:
        words = len(item.prompt.split())
        assert item.meta["length"] - 12 <= words <= item.meta["length"], (words, item.meta)
        assert item.prompt.endswith(QUESTION) and item.prompt.count(item.target) == 1
        filler = item.prompt[: -len(QUESTION)]
        where = filler.index(f"The secret number is {item.target}.") / len(filler)
        sentences = filler.count(".") - 1
        assert abs(where - item.meta["depth"] / 100) <= 1 / sentences + 0.05, (where, item.meta)
    # a reader that finds the number gets every cell right; one that guesses, none
    found = [task.answer(i, f" {i.target}. The rest") for i in items]
    grades = task.grade(items, found)
    for grade, item in zip(grades, items, strict=True):
        grade["subject"] = item.subject
    result = summarise(task, "direct", grades)
    assert result.metrics["accuracy"] == 1.0 and len(result.subjects) == 6
    assert result.metrics["accuracy@depth=50"] == 1.0 and result.metrics["accuracy@length=64"] == 1.0
    wrong = task.grade(items, [task.answer(i, " 12") for i in items])
    assert not any(g["correct"] for g in wrong)


def test_needle_through_the_cli_measures_the_models_tokens(model_dir, tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["eval", "--model", str(model_dir), "--task", "needle", "--output", str(out)]
    argv += ["--context-lengths", "96,192", "--depths", "0,100", "--no-progress"]
    assert cli(argv) == 0
    printed = capsys.readouterr().out
    assert "192 tokens, depth 100%" in printed and "accuracy@length=96" in printed
    result = _results(out, "needle")
    assert len(result["items"]) == 2 * 2 * 2
    # within the shortest filler sentence of the asked length (this tokenizer: ~20 tokens)
    assert all(i["length"] - 24 <= i["tokens"] <= i["length"] for i in result["items"])
    err = _one_line_error(capsys, [*argv[:5], "--depths", "0,150"])
    assert "--depths must be percentages in [0, 100], got [0, 150]" in err
    err = _one_line_error(capsys, [*argv[:5], "--context-lengths", "100000"])
    assert "does not fit the model's context" in err
    err = _one_line_error(capsys, ["eval", "--model", str(model_dir), "--task", "mmlu",
                                   "--data", str(tmp_path), "--depths", "50"])  # fmt: skip
    assert "options of --task needle" in err
