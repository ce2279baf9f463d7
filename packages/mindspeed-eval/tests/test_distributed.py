"""Evaluation under torchrun (4 gloo ranks: 2 data-parallel groups of tp=2) gives one
process's log-likelihoods and greedy text; the groups split the items and every rank
reports the whole set, equal to one process; lm-eval's evaluator sees the data-parallel
rank and size, and gathers over the groups."""

import pytest

from mindspeed_core.testing import import_sibling, run_distributed

helpers = import_sibling(__file__, "eval_helpers")
pytest.importorskip("lm_eval")
PAIRS = [("The king is", " old"), ("Water", " is red and blue"), ("", "Seven plus")]


def _score(model_dir: str, tp: int, data: str):
    from pathlib import Path

    import torch

    from mindspeed_eval.loading import load_for_eval
    from mindspeed_eval.runner import RunOptions, run_task
    from mindspeed_eval.scorer import Scorer, ScorerConfig
    from mindspeed_eval.tasks import get_task

    scorer = Scorer(load_for_eval(model_dir, tp=tp), ScorerConfig(batch_size=2))
    task = get_task("mmlu")
    items = task.load(Path(data), shots=1, fewshot=None)
    result = run_task(task, items, scorer, RunOptions(progress=False))
    out = {
        "mesh": (scorer.mesh.dp_rank, scorer.mesh.dp_size),
        "lls": scorer.loglikelihood(PAIRS),
        "text": scorer.generate_until(["The king is", "Water"], until=["."], max_gen_toks=6),
        "answers": [g["answer"] for g in result.grades],
        "item_lls": [g["loglikelihoods"] for g in result.grades],
    }
    import mindspeed_eval.lm

    lm = mindspeed_eval.lm.MindSpeedLM(scorer=scorer)
    gathered = lm.all_gather(torch.tensor(lm.rank)).tolist()
    out["lm"] = (lm.rank, lm.world_size, lm.gather_object(lm.rank), gathered)
    return out


@pytest.mark.distributed
def test_tp2_dp2_equals_one_process(tmp_path):
    model_dir = str(helpers.make_model_dir(tmp_path / "model"))
    data = str(helpers.write_mmlu(tmp_path / "mmlu", num_test=5, num_dev=2))
    single = _score(model_dir, 1, data)
    ranks = run_distributed(_score, 4, model_dir, 2, data, timeout=600)
    assert single["mesh"] == (0, 1)
    assert [r["mesh"] for r in ranks] == [(0, 2), (0, 2), (1, 2), (1, 2)]
    for rank in ranks:
        for (a, greedy_a), (b, greedy_b) in zip(rank["lls"], single["lls"], strict=True):
            assert a == pytest.approx(b, abs=1e-4) and greedy_a == greedy_b
        assert rank["text"] == single["text"]
        assert rank["answers"] == single["answers"]  # every rank reports the whole set
        for got, expected in zip(rank["item_lls"], single["item_lls"], strict=True):
            assert got == pytest.approx(expected, abs=1e-4)
    assert [r["lm"][:2] for r in ranks] == [(0, 2), (0, 2), (1, 2), (1, 2)]
    assert [r["lm"][2] for r in ranks] == [[0, 1], [0, 1], None, None]
    assert all(r["lm"][3] == [0, 1] for r in ranks)


@pytest.mark.slow
@pytest.mark.distributed
def test_a_tied_odd_vocabulary_under_tp2_equals_one_process(tmp_path):
    """vocab 777 (padded to 1024 rows under tp=2, never scored or generated) and tied
    embeddings: the log-likelihoods, greedy text and answers of one process."""
    folder = tmp_path / "model"
    model_dir = str(helpers.make_model_dir(folder, vocab_size=777, tie_word_embeddings=True))
    data = str(helpers.write_mmlu(tmp_path / "mmlu", num_test=3, num_dev=1))
    single = _score(model_dir, 1, data)
    for rank in run_distributed(_score, 2, model_dir, 2, data, timeout=600):
        for (a, greedy_a), (b, greedy_b) in zip(rank["lls"], single["lls"], strict=True):
            assert a == pytest.approx(b, abs=1e-4) and greedy_a == greedy_b
        assert rank["text"] == single["text"]
        assert rank["answers"] == single["answers"]
