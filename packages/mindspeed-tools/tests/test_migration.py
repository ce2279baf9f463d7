"""`docs/migrating-from-mindspeed-llm.md` is generated from one table whose every field exists
in its command's config class (a renamed or removed field fails here)."""

from pathlib import Path

from mindspeed_tools.migration import ROWS, field_exists, render

DOC = Path(__file__).resolve().parents[3] / "docs" / "migrating-from-mindspeed-llm.md"
ASKED = ("--tensor-model-parallel-size", "--sequence-parallel", "--use-distributed-optimizer",
         "--recompute-granularity", "--prompt-type", "--finetune", "--is-instruction-dataset",
         "--stage dpo")  # fmt: skip


def test_every_field_named_exists():
    targets = [t for _, t, _ in ROWS if not t.startswith(("not needed", "not built", "mindspeed "))]
    assert len(targets) > 40
    assert [t for t in targets if not field_exists(t)] == []
    assert not field_exists("pretrain:parallel.no_such_field")  # the check can fail
    assert not field_exists("sft:lora.rank.deeper")


def test_the_doc_is_the_table_and_covers_the_common_flags():
    assert DOC.read_text() == render(), "regenerate: python -m mindspeed_tools.migration > docs/..."
    flags = " ".join(flag for flag, _, _ in ROWS)
    assert all(name in flags for name in ASKED)
