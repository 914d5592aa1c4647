"""What the workflow commands of the ``znni`` CLI share: the one error wrapper
(:func:`one_line_errors`), the ``--help`` panels, ``--memory`` parsing, and :func:`command`, which
records a command for :func:`~.cli.register`.  The commands are in :mod:`.run_commands` (a run's
setup and the workflow's steps) and :mod:`.inspect_commands` (looking at a run)."""

from __future__ import annotations

import functools
from typing import Optional

import typer

from ..errors import ConfigError, DataError, ZnniError
from ..units import parse_bytes

RUN_HELP = "the run file <work_dir>/run.json written by `znni validate` (or the config.yaml, mapped to it)"


def fail(exc: Exception, code: int | None = None):
    """Print ``error: <message>`` (no traceback) and exit: ``code``, else the error's
    ``exit_code`` (2: a wrong input or request; 1: a failure while running)."""
    typer.echo(f"error: {exc}", err=True)
    raise typer.Exit(code if code is not None else getattr(exc, "exit_code", 1))


def _log(msg: str) -> None:
    typer.echo(msg, err=True)


def _argument_file(kwargs: dict):
    """The file argument a command was given (its run file or config), for a message."""
    return next((kwargs[k] for k in ("run_file", "config") if kwargs.get(k) is not None), None)


def one_line_errors(command):
    """``command`` with every error that escapes it printed as one line (:func:`fail`), never a
    traceback: a :class:`~znni_core.errors.ZnniError` as it is; an OS error (a directory where a
    file is expected, a path that cannot be read or written) or text that is not UTF-8 as a
    :class:`~znni_core.errors.ConfigError` (the path is wrong: exit 2) or a
    :class:`~znni_core.errors.DataError` (the storage failed: exit 1) naming the file."""

    @functools.wraps(command)
    def run(*args, **kwargs):

        try:
            return command(*args, **kwargs)
        except ZnniError as exc:
            fail(exc)
        except UnicodeDecodeError as exc:
            fail(
                ConfigError(f"{_argument_file(kwargs) or 'a file'}: not UTF-8 text ({exc.reason} at byte {exc.start})")
            )
        except OSError as exc:
            path = exc.filename2 if exc.filename2 is not None else exc.filename
            what = f"{path}: " if path is not None else ""
            if isinstance(exc, (IsADirectoryError, NotADirectoryError, FileNotFoundError, FileExistsError)):
                kind = "a directory" if isinstance(exc, IsADirectoryError) else None
                fail(
                    ConfigError(
                        f"{what}{exc.strerror or exc}"
                        + (f" ({kind} where a file is expected)" if kind else "")
                        + "; check the path given"
                    )
                )
            fail(DataError(f"{what}{exc.strerror or exc}; fix the storage (permissions, disk) and re-run"))

    return run


# `znni --help` groups the commands: what a user types, and the steps the workflow's rules run
# (still callable: re-running one task by hand is `run-task`, a user command).
PANELS = {
    "Inference": ("info", "plan", "infer", "warmup"),
    "Runs": ("demo-data", "validate", "estimate", "status", "run-task", "verify", "report", "serve"),
    "Workflow steps (run by the Snakemake rules)": (
        "create-layer",
        "tasks",
        "mask-tasks",
        "run-job",
        "pyramid",
        "finalize",
    ),
}


def help_panel(name: str) -> str:
    """The ``--help`` panel of command ``name``."""
    return next((panel for panel, names in PANELS.items() if name in names), "Runs")


MEMORY_HELP = "e.g. 4GiB or 4000MiB (a bare number is bytes)"


def memory_mib(text: Optional[str], mem_mb: Optional[int] = None, option: str = "--memory") -> Optional[int]:
    """``--memory`` (a size: ``4GiB``, ``4000MiB``) in MiB, the unit of Snakemake's ``mem_mb``;
    ``mem_mb`` is the deprecated ``--mem-mb`` (MiB), accepted with a warning."""
    if mem_mb is not None:
        if text is not None:
            raise ConfigError(f"{option} and --mem-mb given: give {option} only (--mem-mb is deprecated)")
        _log(f"warning: --mem-mb is deprecated; use {option} {mem_mb}MiB")
        return mem_mb
    if text is None:
        return None
    try:
        b = parse_bytes(text)
    except ValueError as exc:
        raise ConfigError(f"{option} {text}: {exc}") from None
    if b < 2**20:
        raise ConfigError(f"{option} {text}: {b} bytes is less than 1 MiB; give a unit, e.g. {text}MiB")
    return b // 2**20


def _deprecated_mem_mb():
    return typer.Option(None, "--mem-mb", hidden=True, help="deprecated: --memory NMiB")


#: the commands, in the order ``--help`` lists them: ``(name, typer.command keywords, function)``
COMMANDS: list = []


def command(name: str, **kwargs):
    """Record the decorated function as the command ``name`` (``typer.Typer.command``'s keywords)."""

    def record(fn):
        COMMANDS.append((name, kwargs, fn))
        return fn

    return record
