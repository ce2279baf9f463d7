"""The docs keep their promises: every feature row in docs/features.md names files (and
`file.py::test_name` functions) that exist and says its status first; the README links the
feature list and keeps CI's two commands word for word; it links docs/architecture.md,
and every path that page writes in backticks exists.

A bare `test_b.py` after `packages/x/tests/test_a.py` in the same cell lives in the same
folder, as a reader would assume.
"""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FEATURES = ROOT / "docs" / "features.md"
README = ROOT / "README.md"

HEADER = "| feature | status | proof |"
STATUSES = ("working", "partial", "measured", "planned")
TWO_COMMANDS = ("uv run mindspeed pretrain", 'uv run pytest -m "not slow"')
"""The README's two commands (their comments, such as the suite's time, may change)."""
# a backticked path: its first word, ending in a file suffix, optionally `::test_name`
_PATH = re.compile(r"^(?P<path>[\w./*-]+\.(?:py|sh|md))(?:::(?P<name>\w+))?$")


def _cells(row: str) -> list[str]:
    """A markdown row's cells; `\\|` inside a cell is text, not a border."""
    return [c.strip() for c in re.split(r"(?<!\\)\|", row.strip().strip("|"))]


def feature_rows(text: str) -> list[list[str]]:
    """The body rows of every table whose header is `HEADER`."""
    rows, in_table = [], False
    for line in text.splitlines():
        if line.strip() == HEADER:
            in_table = True
        elif in_table and line.startswith("|"):
            if not line.startswith("|---"):
                rows.append(_cells(line))
        else:
            in_table = False
    return rows


def named_paths(cell: str) -> list[tuple[str, str | None]]:
    """(path from the repository root, test name or None) for each file a cell names."""
    found, folder = [], ""
    for code in re.findall(r"`([^`]+)`", cell):
        match = _PATH.match(code.split()[0])
        if not match:
            continue
        path = match["path"]
        if "/" in path:
            folder = path.rsplit("/", 1)[0] + "/"
        else:
            path = folder + path
        found.append((path, match["name"]))
    return found


def _defines(path: Path, name: str) -> bool:
    tree = ast.parse(path.read_text())
    return any(
        isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == name
        for node in ast.walk(tree)
    )


def missing(text: str, root: Path = ROOT) -> list[str]:
    """Every named file (glob: at least one match) or `::test` that does not exist."""
    problems = []
    for row in feature_rows(text):
        for cell in row:
            for path, name in named_paths(cell):
                files = sorted(root.glob(path)) if "*" in path else [root / path]
                if not files or not all(f.is_file() for f in files):
                    problems.append(path)
                elif name and not _defines(files[0], name):
                    problems.append(f"{path}::{name}")
    return problems


def test_every_named_file_and_test_exists():
    text = FEATURES.read_text()
    assert len(feature_rows(text)) >= 60
    assert missing(text) == []


def test_the_parser_finds_what_is_missing():
    planted = "\n".join(
        [
            HEADER,
            "|---|---|---|",
            "| a | working | `integration_tests/test_docs.py::test_nowhere`, `test_gone.py`,"
            " `packages/mindspeed-core/tests/test_cli.py`, `test_vanished.py` |",
            "| b | planned | `benchmarks/nothing_*.py`, `benchmarks/ops.py --ops linear`,"
            " `integration_tests/test_docs.py::test_the_parser_finds_what_is_missing` |",
        ]
    )
    assert missing(planted) == [
        "integration_tests/test_docs.py::test_nowhere",
        "integration_tests/test_gone.py",
        "packages/mindspeed-core/tests/test_vanished.py",
        "benchmarks/nothing_*.py",
    ]
    # a \| inside a cell does not split it
    assert _cells(r"| `a \| b` | working | x |") == [r"`a \| b`", "working", "x"]


def test_every_row_says_its_status_first():
    rows = feature_rows(FEATURES.read_text())
    assert all(len(row) == 3 for row in rows), [row[0][:60] for row in rows if len(row) != 3]
    unstated = [row[0][:60] for row in rows if not row[1].startswith(STATUSES)]
    assert unstated == []


def test_readme_links_the_features_and_keeps_the_two_commands():
    text = README.read_text()
    assert "(docs/features.md)" in text
    lines = text.splitlines()
    for command in TWO_COMMANDS:
        assert any(line.split("#")[0].strip() == command for line in lines), command
    assert HEADER not in text, "the feature table lives in docs/features.md"


ARCHITECTURE = ROOT / "docs" / "architecture.md"
# a backticked word with a slash, made of path characters only: a path from the repository
# root (`packages/x/`, `examples/kl_sft.py`); `step_<N>` or `--from`/`--to` are not paths
_REPO_PATH = re.compile(r"^[\w.-]+(?:/[\w.-]+)*/?$")


def backticked_paths(text: str) -> list[str]:
    """Every path written in backticks outside fenced code blocks."""
    prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    words = [code.split()[0] for code in re.findall(r"`([^`\n]+)`", prose) if code.strip()]
    return [w for w in words if "/" in w and _REPO_PATH.match(w)]


def test_readme_links_the_architecture_and_its_paths_exist():
    assert "(docs/architecture.md)" in README.read_text()
    paths = backticked_paths(ARCHITECTURE.read_text())
    assert len(paths) >= 30
    assert [p for p in paths if not (ROOT / p).exists()] == []


def test_the_path_walk_finds_paths_and_skips_the_rest():
    planted = "`a/b.py` and `docs/`, `step_<N>/`, `--from`/`--to`, `x`\n```\n`in/code.py`\n```\n"
    assert backticked_paths(planted) == ["a/b.py", "docs/"]


SECURITY = ROOT / "SECURITY.md"
CODE_SPEC = re.compile(r'"module:(function|Class)"')
"""How a config field's docstring says its value names code to import."""


def code_spec_fields(root: Path = ROOT) -> set[str]:
    """Every config field (of a dataclass under packages/*/src) whose value names code to
    import: its attribute docstring says "module:function" or "module:Class"."""
    fields = set()
    for path in root.glob("packages/*/src/**/*.py"):
        for cls in ast.walk(ast.parse(path.read_text())):
            if not isinstance(cls, ast.ClassDef):
                continue
            body = cls.body
            for field, doc in zip(body, body[1:], strict=False):
                if (isinstance(field, ast.AnnAssign) and isinstance(field.target, ast.Name)
                        and isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant)
                        and CODE_SPEC.search(str(doc.value.value))):  # fmt: skip
                    fields.add(field.target.id)
    return fields


def test_security_lists_every_option_that_imports_code():
    """SECURITY.md's "Inputs that run code by design" names every config field whose value
    is a "module:..." spec (grpo.rewards, grpo.env, ...)."""
    text = SECURITY.read_text()
    section = text.split("## Inputs that run code by design", 1)[1].split("\n## ", 1)[0]
    fields = code_spec_fields()
    assert {"rewards", "env"} <= fields, fields
    for field in sorted(fields):
        assert f"`grpo.{field}`" in section, f"SECURITY.md does not list grpo.{field}"
