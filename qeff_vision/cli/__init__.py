"""Command-line entry point. Thin and lazy: subcommands are imported on first use, torch never at start-up.

Every command calls :mod:`qeff_vision.api`; this package only parses arguments and prints.
A :class:`~qeff_vision.errors.UserError` becomes one line on stderr and exit code 2.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import sys

import click

from qeff_vision import __version__, interrupts
from qeff_vision.errors import UserError

# name -> (module, attribute, one-line help shown by --help without importing the module)
COMMANDS: dict[str, tuple[str, str, str]] = {
    "families": ("qeff_vision.cli.families", "families", "List supported model families and their features."),
    "tiny": ("qeff_vision.cli.tiny", "tiny", "Write a tiny random-weight checkpoint of a family."),
    "export": ("qeff_vision.cli.export", "export", "Export the vision encoder and language decoder to ONNX."),
    "specialize": (
        "qeff_vision.cli.specialize",
        "specialize",
        "Write specializations and custom IO from a spec.",
    ),
    "validate": ("qeff_vision.cli.validate", "validate", "Check spec files and report every problem."),
    "compile": (
        "qeff_vision.cli.compile",
        "compile_command",
        "Compile both programs (dual QPC) from a spec.",
    ),
    "run": ("qeff_vision.cli.run", "run", "Generate text with compiled artifacts, chunk-aware."),
}


class Interrupted(BaseException):
    """Ctrl-C inside a command, carried past click (which would print an empty line for it)."""


class LazyGroup(click.Group):
    """A group whose subcommands live in modules imported only when invoked."""

    def invoke(self, ctx: click.Context):
        """Run the subcommand; a KeyboardInterrupt leaves as :class:`Interrupted`."""
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            raise Interrupted from None

    def list_commands(self, ctx: click.Context) -> list[str]:
        """Commands whose modules exist, sorted."""
        return sorted(name for name, (module, _, _) in COMMANDS.items() if _module_exists(module))

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        """Import the command's module on demand (a stub carrying the help line for --help)."""
        if cmd_name not in COMMANDS:
            return None
        module_name, attribute, short_help = COMMANDS[cmd_name]
        if ctx.resilient_parsing or set(sys.argv[1:2]) & {"--help", "-h"}:
            # `qeff-vision --help` lists commands: keep it import-free.
            return click.Command(cmd_name, short_help=short_help, help=short_help)
        if not _module_exists(module_name):
            return None
        return getattr(importlib.import_module(module_name), attribute)


def _module_exists(module_name: str) -> bool:
    return importlib.util.find_spec(module_name) is not None


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="qeff-vision")
def cli() -> None:
    """qeff-vision: export -> specialize -> compile -> run vision-language models for Cloud AI 100.

    The language decoder takes vision_embeds with a dynamic vision_size axis, so each prefill
    chunk carries only the image rows it needs.
    """


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; user errors become one stderr line and exit code 2, Ctrl-C "interrupted" and 130."""
    interrupts.install()
    try:
        # Without standalone mode click returns ctx.exit(code)'s code (or the command's value).
        result = cli.main(args=argv, prog_name="qeff-vision", standalone_mode=False)
    except UserError as exc:
        return _error(str(exc))
    except (Interrupted, click.exceptions.Abort, KeyboardInterrupt):
        # click turns Ctrl-C (and EOF at a prompt) into Abort.
        click.echo("qeff-vision: interrupted", err=True)
        return 130
    except click.ClickException as exc:
        return _error(exc.format_message())
    except click.exceptions.Exit as exc:
        return exc.exit_code
    except OSError as exc:
        # An operating-system refusal the checks before it did not foresee (a disk that filled,
        # a directory removed underneath us): still the environment, still one line.
        return _error(os_error_text(exc))
    if interrupts.interrupted():  # a Ctrl-C whose KeyboardInterrupt a library swallowed
        click.echo("qeff-vision: interrupted", err=True)
        return 130
    return result if isinstance(result, int) else 0


def _error(message: str) -> int:
    click.echo(f"qeff-vision: error: {message}", err=True)
    return 2


def os_error_text(exc: OSError) -> str:
    """``PATH: reason`` of an OSError (both paths of a failed rename)."""
    paths = [str(name) for name in (exc.filename, exc.filename2) if name is not None]
    reason = exc.strerror or str(exc)
    return f"{' -> '.join(paths)}: {reason}" if paths else reason


def entry() -> None:
    """Console-script entry point.

    Ends with ``os._exit`` once the output is flushed: the command's own cleanup has run by then,
    and an interpreter that saw a KeyboardInterrupt inside a library's C++ would otherwise kill
    itself with SIGINT at exit (exit status -2 instead of 130).
    """
    code = main()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)
