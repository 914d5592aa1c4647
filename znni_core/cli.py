"""The ``znni`` command line: engine commands here, workflow commands from :mod:`znni_core.pipeline.cli`."""
from __future__ import annotations

import typer

app = typer.Typer(no_args_is_help=True, add_completion=False,
                  help="znni: exact dense sliding-window inference of 3D ConvNets over EM volumes.")


def _register_pipeline() -> None:
    from .pipeline import cli as pipeline_cli

    pipeline_cli.register(app)


_register_pipeline()


def main() -> None:  # console-script entry point
    app()


if __name__ == "__main__":
    main()
