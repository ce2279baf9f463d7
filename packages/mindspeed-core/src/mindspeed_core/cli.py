"""The `mindspeed` command.

Subcommands come from the entry-point group `mindspeed.commands`: each
installed MindSpeed package adds its own, so a user who installed only core and
llm sees only their commands. An entry point names a `Command`.

User mistakes (`MindSpeedError`) print one line and exit with status 2; so does a
collective that lost a peer (one line naming the rank that died, instead of the
backend's traceback). Pass `--debug` or set MINDSPEED_DEBUG=1 to see the traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points

from mindspeed_core import __version__
from mindspeed_core.errors import ConfigError, MindSpeedError

COMMAND_GROUP = "mindspeed.commands"
EXIT_USER_ERROR = 2


@dataclass(frozen=True)
class Command:
    """A `mindspeed` subcommand.

    Attributes:
        help: one line shown in `mindspeed --help`.
        run: takes the arguments after the subcommand's name; returns an exit
            status (None means 0). Raise `MindSpeedError` for user mistakes.
    """

    help: str
    run: Callable[[list[str]], int | None]
    config_cls: type | None = None
    """The config dataclass of a command made by `config_command` (tests walk its fields)."""


def config_command(
    name: str, config_cls: type, run: Callable[[object], object], *, help: str, demo: str
) -> Command:
    """`mindspeed NAME [--config FILE] [--section.field VALUE ...]`: reads `config_cls`
    (YAML plus dotted overrides), sets up logging and calls `run(cfg)`; `--help` lists
    every field with its default. `demo` says what the command does with no arguments."""
    from mindspeed_core.config import config_from_args, to_dict
    from mindspeed_core.distributed import setup_logging

    def usage() -> str:
        lines = [f"usage: mindspeed {name} [--config FILE] [--section.field VALUE ...]", "",
                 f"With no arguments: {demo}", "Fields and defaults:"]  # fmt: skip
        for section, values in to_dict(config_cls()).items():
            if isinstance(values, dict):
                lines += [f"  --{section}.{field} {value}" for field, value in values.items()]
        return "\n".join(lines)

    def main(argv: list[str]) -> int:
        if any(a in ("-h", "--help") for a in argv):
            print(usage())
            return 0
        cfg = config_from_args(config_cls, argv)
        setup_logging()
        run(cfg)
        return 0

    return Command(help=help, run=main, config_cls=config_cls)


class ArgumentParser(argparse.ArgumentParser):
    """argparse for subcommands: a mistake is a ConfigError (one line, exit 2), not a
    usage dump with exit 2 from inside argparse."""

    def error(self, message):
        raise ConfigError(f"{self.prog}: {message} (see --help)")


def discover_commands() -> dict[str, EntryPoint]:
    """Installed subcommands by name (not yet imported)."""
    return {ep.name: ep for ep in entry_points(group=COMMAND_GROUP)}


def debug_enabled(argv: Sequence[str] = ()) -> bool:
    return "--debug" in argv or os.environ.get("MINDSPEED_DEBUG", "") not in ("", "0")


def guarded(fn: Callable[..., int | None], *args, debug: bool = False) -> int:
    """Call `fn(*args)`; a MindSpeedError becomes one line on stderr and status 2."""
    try:
        return int(fn(*args) or 0)
    except MindSpeedError as e:
        if debug:
            traceback.print_exc()
        message = " ".join(str(e).split()) or e.__class__.__name__
        print(f"error: {message}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except RuntimeError as e:  # torch.distributed's errors (DistBackendError among them)
        from mindspeed_core.distributed import lost_peer_message  # (torch: only when needed)

        message = None if debug else lost_peer_message(e)
        if message is None:
            raise
        print(f"error: {message}", file=sys.stderr)
        # The job is broken: tearing down its process group at interpreter exit can abort
        # ("terminate called without an active exception"), so leave now.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_USER_ERROR)


def _usage(commands: dict[str, EntryPoint]) -> str:
    lines = [
        "usage: mindspeed [--version] [--debug] <command> [args ...]",
        "",
        "commands:",
    ]
    for name in sorted(commands):
        try:
            help_text = commands[name].load().help
        except Exception as e:  # a broken package must not hide the others
            help_text = f"(failed to load: {e.__class__.__name__}: {e})"
        lines.append(f"  {name:<12} {help_text}")
    lines += ["", "Run 'mindspeed <command> --help' for a command's options."]
    return "\n".join(lines)


def run(argv: Sequence[str] | None = None) -> int:
    """Run the CLI with `argv` (without the program name); returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = debug_enabled(argv)
    argv = [a for a in argv if a != "--debug"]
    commands = discover_commands()
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage(commands))
        return 0
    if argv[0] in ("-V", "--version"):
        print(f"mindspeed {__version__}")
        return 0
    name = argv[0]
    if name not in commands:
        installed = ", ".join(sorted(commands)) or "none"
        print(f"error: unknown command {name!r}; installed commands: {installed}", file=sys.stderr)
        return EXIT_USER_ERROR
    command = commands[name].load()
    return guarded(command.run, argv[1:], debug=debug)


def main(argv: Sequence[str] | None = None) -> None:
    """Console-script entry point."""
    sys.exit(run(argv))


if __name__ == "__main__":  # `python -m mindspeed_core.cli COMMAND ...`, e.g. under torchrun
    main()
