"""Multiple-choice benchmarks on MindSpeed-LLM's local layouts: MMLU, C-Eval, BoolQ, AGIEval.

Prompts follow MindSpeed-LLM's evaluators (`mindspeed_llm/tasks/evaluation/eval_impl`):
the n-shot text is built from the benchmark's own dev files in the format of its shipped
few-shot templates, or read from such a template (`--fewshot-template FILE`).
"""

from __future__ import annotations

from pathlib import Path

from mindspeed_eval.tasks.base import (
    LETTERS,
    Item,
    Task,
    read_csv,
    read_jsonl,
    split_folder,
    subject_of,
)

MMLU_COLUMNS = ("question", "A", "B", "C", "D", "answer")


def _options(row: dict) -> str:
    return "\n".join(f"{letter}. {row[letter]}" for letter in "ABCD")


class MMLU(Task):
    """MMLU: `test/{subject}_test.csv` (question,A,B,C,D,answer; no header) and
    `dev/{subject}_dev.csv` for the shots."""

    name = "mmlu"
    layout = (
        "test/{subject}_test.csv and dev/{subject}_dev.csv (question,A,B,C,D,answer; no header)"
    )
    default_shots = 5
    split, suffix, header, columns = "test", "_test.csv", False, MMLU_COLUMNS
    choices = (" A", " B", " C", " D")

    def load(self, data: Path, *, shots: int, fewshot: dict | None) -> list[Item]:
        folder = split_folder(data, self.split, self.suffix)
        files = sorted(folder.glob(f"*{self.suffix}"))
        if not files:
            raise self.missing(data, f"no *{self.suffix} files in {folder}")
        items = []
        for path in files:
            subject = subject_of(path)
            rows = read_csv(path, self.columns, header=self.header)
            dev = self._dev(folder, subject, shots)
            shot_text = (
                fewshot[subject] if fewshot and subject in fewshot else self.shots(subject, dev)
            )
            for number, row in enumerate(rows, 2 if self.header else 1):
                answer = row["answer"].strip()
                if answer not in ("A", "B", "C", "D"):
                    raise self.missing(
                        path, f"line {number}: answer {answer!r} is not A, B, C or D"
                    )
                items.append(self.item(subject, row, shot_text, dev))
        return items

    def _dev(self, folder: Path, subject: str, shots: int) -> list[dict]:
        path = folder.parent / "dev" / f"{subject}_dev.csv"
        if shots == 0 or not path.is_file():
            return []
        return read_csv(path, self.columns, header=self.header)[:shots]

    def shots(self, subject: str, dev: list[dict]) -> str:
        """MindSpeed-LLM's mmlu_5shot_template.json format."""
        header = f"The following are multiple choice questions (with answers) about  {subject.replace('_', ' ')}.\n"
        return header + "\n".join(
            f"{r['question']}\n{_options(r)}\nAnswer: {r['answer']}" for r in dev
        )

    def item(self, subject: str, row: dict, shot_text: str, dev: list[dict]) -> Item:
        question = f"{row['question']}\n{_options(row)}"
        messages = []
        for i, r in enumerate(dev):
            system = (
                f"The following are multiple choice questions (with answers) about {subject}.\n\n"
            )
            user = f"{r['question']}\n{_options(r)}\nAnswer: "
            messages += [{"role": "user", "content": (system if i == 0 else "") + user},
                         {"role": "assistant", "content": r["answer"]}]  # fmt: skip
        messages.append({"role": "user", "content": f"{question}\nAnswer: "})
        return Item(
            subject=subject,
            prompt=f"{shot_text}\n\n{question}\nAnswer:",
            target=row["answer"].strip(),
            choices=self.choices,
            messages=messages,
        )


class CEval(MMLU):
    """C-Eval: `val/{subject}_val.csv` with a header (id,question,A,B,C,D,answer,...) and
    `dev/{subject}_dev.csv` for the shots."""

    name = "ceval"
    layout = "val/{subject}_val.csv and dev/{subject}_dev.csv (header: id,question,A,B,C,D,answer)"
    split, suffix, header = "val", "_val.csv", True
    choices = ("A", "B", "C", "D")

    def shots(self, subject: str, dev: list[dict]) -> str:
        """MindSpeed-LLM's ceval_5shot_template.json format."""
        examples = "\n\n".join(
            f"问：{r['question']}\n{_options(r)}\n答：{r['answer']}" for r in dev
        )
        return "请从下列选择题中选择正确的选项。" + (f"\n\n{examples}" if examples else "")

    def item(self, subject: str, row: dict, shot_text: str, dev: list[dict]) -> Item:
        item = super().item(subject, row, shot_text, dev)
        item.prompt = f"{shot_text}\n\n问：{row['question']}\n{_options(row)}\n答："
        return item


class BoolQ(Task):
    """BoolQ: `dev.jsonl` (question, passage, answer true/false), zero-shot."""

    name = "boolq"
    layout = "a *dev*.jsonl file with question, passage and answer (true/false) per line"
    max_gen_toks = 4

    def load(self, data: Path, *, shots: int, fewshot: dict | None) -> list[Item]:
        files = [data] if data.is_file() else sorted(data.glob("*dev*.jsonl"))
        if not files:
            raise self.missing(data, "no *dev*.jsonl file")
        items = []
        for path in files:
            for number, row in enumerate(read_jsonl(path, ("question", "passage", "answer")), 1):
                if not isinstance(row["answer"], bool):
                    raise self.missing(
                        path, f"line {number}: answer {row['answer']!r} is not true/false"
                    )
                items.append(
                    Item(
                        subject="boolq",
                        prompt=f"{row['passage']}\nQuestion: {row['question']}?\nAnswer:",
                        target="Yes" if row["answer"] else "No",
                        choices=(" Yes", " No"),
                        labels=("Yes", "No"),
                    )
                )
        return items

    def answer(self, item: Item, text: str) -> str:
        word = (text.strip().split() or [""])[0].strip(".,!").lower()
        return {"yes": "Yes", "true": "Yes", "no": "No", "false": "No"}.get(word, word)


class AGIEval(Task):
    """AGIEval: `{subject}.jsonl` (passage, question, options, label[, answer]); items
    without options or with several labels are answered by generation."""

    name = "agieval"
    layout = "{subject}.jsonl files with passage, question, options and label per line"
    max_gen_toks = 16

    def load(self, data: Path, *, shots: int, fewshot: dict | None) -> list[Item]:
        files = sorted(data.glob("*.jsonl"))
        if not files:
            raise self.missing(data, "no *.jsonl files")
        items = []
        for path in files:
            subject = subject_of(path)
            shot, ask, answer = (fewshot or {}).get(subject) or (
                "",
                "Choose from the following options:",
                "Answer:",
            )
            for row in read_jsonl(path, ("question",)):
                question = " ".join(p for p in (row.get("passage") or "", row["question"]) if p)
                options = row.get("options") or []
                label = row.get("label") or row.get("answer") or ""
                single = isinstance(label, str) and len(label) == 1 and bool(options)
                prompt = f"{shot}   {question}\n{ask}\n" + "\n".join(options) + f"\n{answer}"
                items.append(
                    Item(
                        subject=subject,
                        prompt=prompt.lstrip(),
                        target="".join(label) if isinstance(label, list) else str(label),
                        choices=tuple(f" {LETTERS[i]}" for i in range(len(options)))
                        if single
                        else (),
                    )
                )
        return items

    def answer(self, item: Item, text: str) -> str:
        first = (text.strip().splitlines() or [""])[0]
        return first.replace("$", "").replace("(", "").replace(")", "").strip()
