"""Workflow commands of the ``znni`` CLI (run-task, tasks, create-layer, finalize, demo-data ...)."""
from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    """Add the workflow commands to the main ``znni`` app."""
