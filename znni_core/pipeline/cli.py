"""The workflow commands of the ``znni`` CLI, added to the main app (:mod:`znni_core.cli`):
:mod:`.run_commands` (a run's setup and the workflow's steps) and :mod:`.inspect_commands`
(looking at a run), each under the one error wrapper, in its ``--help`` panel."""

from __future__ import annotations

import typer

from . import inspect_commands, run_commands  # noqa: F401 - importing them records their commands
from .cli_base import COMMANDS, MEMORY_HELP, PANELS, fail, help_panel, memory_mib, one_line_errors

__all__ = ["MEMORY_HELP", "PANELS", "fail", "memory_mib", "register"]


def register(app: typer.Typer) -> None:
    """Add the workflow commands to the main ``znni`` app, each under :func:`one_line_errors`,
    each in its ``--help`` panel."""
    listed = [name for names in PANELS.values() for name in names]  # --help's order
    for name, kwargs, fn in sorted(COMMANDS, key=lambda c: listed.index(c[0]) if c[0] in listed else len(listed)):
        app.command(name, **kwargs)(one_line_errors(fn))
    for info in app.registered_commands:
        info.rich_help_panel = help_panel(info.name or info.callback.__name__)
