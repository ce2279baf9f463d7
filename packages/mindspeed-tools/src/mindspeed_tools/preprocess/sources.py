"""Input files: find them (a file, a folder or a glob) and read their records in order.

Every record comes with where it was found (`file:line` or `file: row N`) so a bad one
can be reported. JSON Lines and text files are read line by line here: Hugging Face
`datasets` fails a whole json file on one broken line and forgets line numbers. Parquet,
Arrow (streams, as `datasets` saves them) and CSV go through `datasets` (streamed,
offline, cache in a temporary folder).
"""

from __future__ import annotations

import glob
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path

from mindspeed_core.errors import DataError

__all__ = ["FORMATS", "BadText", "Item", "count_records", "find_inputs", "read_items"]

FORMATS = {
    ".json": "json",
    ".jsonl": "json",
    ".parquet": "parquet",
    ".arrow": "arrow",
    ".csv": "csv",
    ".txt": "text",
}

COUNT_LIMIT = 4 << 30  # beyond this, counting lines for the progress bar costs too much
_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")

Item = tuple[str, str | None, object]
"""(where, raw JSON text to parse or None, parsed record or None)."""


def find_inputs(spec: str) -> list[Path]:
    """The data files named by `spec`: a file, a folder (its data files), or a glob.

    Raises:
        DataError: nothing exists there, a named file has an unsupported suffix, or a
            folder or glob holds no data file.
    """
    path = Path(spec)
    if path.is_file():
        if path.suffix.lower() not in FORMATS:
            raise DataError(f"unsupported input file {path}: expected one of {sorted(FORMATS)}")
        return [path]
    if path.is_dir():
        candidates = sorted(p for p in path.iterdir() if p.is_file())
    elif glob.has_magic(spec):
        candidates = sorted(Path(p) for p in glob.glob(spec, recursive=True) if Path(p).is_file())
    elif _HUB_NAME.match(spec):
        raise DataError(
            f"input does not exist: {spec}; MindSpeed does not download at run time. If it is "
            f"a Hugging Face dataset, fetch it first (`huggingface-cli download {spec} "
            "--repo-type dataset --local-dir DIR`) and pass the local folder"
        )
    else:
        raise DataError(f"input does not exist: {spec}")
    files = [p for p in candidates if p.suffix.lower() in FORMATS and not p.name.startswith(".")]
    if not files:
        raise DataError(f"no {'/'.join(sorted(FORMATS))} files in {spec}")
    return files


def read_items(files: list[Path], cache_dir: str) -> Iterator[Item]:
    """Every record of `files`, in order."""
    for path in files:
        fmt = FORMATS[path.suffix.lower()]
        if fmt == "json":
            yield from _read_json(path)
        elif fmt == "text":
            for where, line in _lines(path):  # a BadText goes raw: the worker reports it
                yield (
                    (where, line, None)
                    if isinstance(line, BadText)
                    else (where, None, {"text": line})
                )
        else:
            yield from _read_with_datasets(path, fmt, cache_dir)


def count_records(files: list[Path]) -> int | None:
    """How many records `files` hold, for the progress bar; None when it would be costly.

    Lines of JSON Lines and text files (a scan at disk speed), rows of parquet files
    (their footer); CSV files, JSON arrays and inputs over `COUNT_LIMIT` bytes of text
    are not counted.
    """
    text_bytes = sum(p.stat().st_size for p in files if FORMATS[p.suffix.lower()] != "parquet")
    if text_bytes > COUNT_LIMIT:
        return None
    total = 0
    for path in files:
        fmt = FORMATS[path.suffix.lower()]
        if fmt == "parquet":
            import pyarrow.parquet as pq

            try:
                total += pq.ParquetFile(path).metadata.num_rows
            except Exception:  # unreadable: reading it will report the error
                return None
        elif fmt == "text" or (fmt == "json" and _first_char(path) != "["):
            total += _count_lines(path)
        else:
            return None
    return total


def _count_lines(path: Path) -> int:
    count, last = 0, b"\n"
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            count += block.count(b"\n")
            last = block[-1:]
    return count + (last != b"\n")  # a last line without a line break


def _lines(path: Path) -> Iterator[tuple[str, str]]:
    """(`file:line`, text without the line break) of every line; bad UTF-8 stays a str."""
    try:
        with open(path, "rb") as f:
            for number, raw in enumerate(f, start=1):
                if number == 1 and raw.startswith(b"\xef\xbb\xbf"):
                    raw = raw[3:]  # a UTF-8 byte order mark
                try:
                    text = raw.decode("utf-8").rstrip("\r\n")
                except UnicodeDecodeError as err:
                    text = BadText(f"not valid UTF-8 at byte {err.start}")
                yield f"{path}:{number}", text
    except OSError as err:
        raise DataError(f"cannot read {path}: {err}") from None


class BadText(str):
    """A line that could not be decoded; its value is the reason."""


def _read_json(path: Path) -> Iterator[Item]:
    """A JSON Lines file line by line, or a file holding one JSON array of records."""
    if _first_char(path) == "[":
        try:
            records = json.loads(path.read_text(encoding="utf-8-sig"))
        except (ValueError, OSError) as err:  # UnicodeDecodeError is a ValueError
            line = f":{err.lineno}" if isinstance(err, json.JSONDecodeError) else ""
            raise DataError(f"{path}{line}: not a valid JSON array: {err}") from None
        for number, record in enumerate(records, start=1):
            yield f"{path}: record {number}", None, record
        return
    for where, line in _lines(path):
        yield where, line, None


def _first_char(path: Path) -> str:
    with open(path, "rb") as f:
        head = f.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
    return head[:1].decode("latin-1")


def _read_with_datasets(path: Path, fmt: str, cache_dir: str) -> Iterator[Item]:
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_CACHE", cache_dir)
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # we report read errors ourselves
    try:
        rows = datasets.load_dataset(
            fmt, data_files=[str(path)], split="train", streaming=True, cache_dir=cache_dir
        )
        for number, row in enumerate(rows, start=1):
            yield f"{path}: row {number}", None, row
    except (ValueError, OSError, TypeError) as err:
        raise DataError(f"cannot read {fmt} file {path}: {err}") from None
    except Exception as err:  # pyarrow and pandas raise their own error types
        if type(err).__module__.split(".")[0] in ("pyarrow", "pandas", "datasets"):
            raise DataError(f"cannot read {fmt} file {path}: {err}") from None
        raise
