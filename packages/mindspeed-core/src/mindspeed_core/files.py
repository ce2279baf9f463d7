"""File-system habits every writer here shares.

- `check_folder`: a path meant to be a folder is not a file (nor inside one), checked
  before anything is written, with a one-line error naming the option.
- `write_file_atomically`: write a synced temporary file, then rename it over the target.
- `staged_folder`: build a folder beside its place and rename it there when complete (a
  reader never sees half of it; a failure leaves the previous one, or nothing).
- Owned temporary names: `owned_temp_prefix(name)` embeds the host and process id in a
  temporary file's name, so a later run can tell the temporaries of a process that died
  (SIGKILL, power loss) from those of one still running, and `remove_stale_temps`
  deletes only the former.
- `read_text` / `text_lines`: a user's text file (config, data, prompts, template) as
  UTF-8, a file that is not (binary, Latin-1) refused on one line naming the file, the
  line and the byte.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
from collections.abc import Callable, Iterator
from pathlib import Path

from mindspeed_core.errors import ConfigError, DataError, MindSpeedError

_OWNED = re.compile(r"\.tmp-(?P<host>[^.]+)\.(?P<pid>\d+)\.")


def read_text(path: str | os.PathLike, what: str = "file", *,
              error: type[MindSpeedError] = DataError) -> str:  # fmt: skip
    """The text of the UTF-8 file `path` (a leading byte-order mark dropped).

    Raises:
        `error` (DataError by default): the file is missing or unreadable (naming `what`,
            e.g. "data file"), or not UTF-8 text (naming its line, column and byte).
    """
    try:
        raw = Path(path).read_bytes()
    except FileNotFoundError:
        raise error(f"{what} does not exist: {path}") from None
    except OSError as err:
        raise error(f"cannot read {what} {path}: {err.strerror or err}") from None
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        line = raw.count(b"\n", 0, err.start) + 1
        column = err.start - (raw.rfind(b"\n", 0, err.start) + 1) + 1
        raise error(_not_utf8(path, line, column, raw[err.start])) from None


def text_lines(path: str | os.PathLike, what: str = "file", *,
               error: type[MindSpeedError] = DataError) -> Iterator[tuple[int, str]]:  # fmt: skip
    """(line number from 1, text without its line break) of every line of the UTF-8 file
    `path`, read a line at a time (a leading byte-order mark dropped).

    Raises:
        `error`: as `read_text`, when the file is missing or a line is not UTF-8.
    """
    try:
        f = open(path, "rb")  # noqa: SIM115 - closed below, the generator may stop early
    except FileNotFoundError:
        raise error(f"{what} does not exist: {path}") from None
    except OSError as err:
        raise error(f"cannot read {what} {path}: {err.strerror or err}") from None
    with f:
        for number, raw in enumerate(f, 1):
            if number == 1 and raw.startswith(b"\xef\xbb\xbf"):
                raw = raw[3:]
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise error(_not_utf8(path, number, err.start + 1, raw[err.start])) from None
            yield number, text.rstrip("\r\n")


def _not_utf8(path, line: int, column: int, byte: int) -> str:
    return (f"{path}:{line}: not UTF-8 text (byte 0x{byte:02x} at column {column}); "
            "save the file as UTF-8")  # fmt: skip


def check_folder(path: str | os.PathLike, what: str) -> Path:
    """`path` as a Path, refusing one that is a file or lies under a file.

    Raises:
        ConfigError: naming `what` (e.g. "--logging.run_dir") and the file in the way.
    """
    folder = Path(path)
    for candidate in (folder, *folder.parents):
        if candidate.exists() and not candidate.is_dir():
            where = "is a file" if candidate == folder else f"lies under the file {candidate}"
            raise ConfigError(f"{what} {folder} {where}, not a folder")
    return folder


def write_file_atomically(
    path: Path, text: str, *, before_replace: Callable[[], None] | None = None
) -> None:
    """Write `text` to `path` through a synced temporary file and a rename.

    `before_replace` runs between the two (fault-injection tests use it).
    """
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    if before_replace is not None:
        before_replace()
    os.replace(tmp, path)
    fsync_dir(path.parent)


@contextlib.contextmanager
def staged_folder(folder: str | os.PathLike) -> Iterator[Path]:
    """Yields an empty staging folder beside `folder`; when the block ends normally the
    staging folder replaces `folder` (an existing one is removed first), otherwise it is
    deleted. Staging names are owned (`owned_temp_prefix`): those of killed processes are
    swept by the next call."""
    import tempfile

    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(folder.parent, folder.name)
    staging = Path(tempfile.mkdtemp(prefix=owned_temp_prefix(folder.name), dir=folder.parent))
    try:
        yield staging
        shutil.rmtree(folder, ignore_errors=True)
        os.replace(staging, folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def fsync_dir(folder: Path) -> None:
    """Make a rename inside `folder` durable (a no-op where folders cannot be synced)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def owned_temp_prefix(name: str) -> str:
    """A temporary-name prefix for `name` owned by this process: `name.tmp-HOST.PID.`."""
    host = re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname()) or "host"
    return f"{name}.tmp-{host}.{os.getpid()}."


def remove_stale_temps(folder: Path, name: str) -> list[Path]:
    """Remove the temporaries of `name` in `folder` whose owning process is gone.

    Only temporaries made on this host by a process that no longer exists are removed
    (another host's, or a live process's, may still be in use). Returns what was removed.
    """
    if not folder.is_dir():
        return []
    host = owned_temp_prefix("x").split(".tmp-")[1].split(".")[0]
    removed = []
    for path in folder.glob(f"{glob_escape(name)}.tmp-*"):
        match = _OWNED.search(path.name[len(name) :])
        if not match or match["host"] != host or _alive(int(match["pid"])):
            continue
        with contextlib.suppress(OSError):
            shutil.rmtree(path) if path.is_dir() else path.unlink()
            removed.append(path)
    return removed


def glob_escape(text: str) -> str:
    """`text` with glob metacharacters escaped."""
    return re.sub(r"([*?\[])", r"[\1]", text)


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True
