"""What the three command-line tools share: their consoles, the error exit and the Typer app they start from."""

from __future__ import annotations

from typing import NoReturn

import typer
from rich.console import Console
from rich.markup import escape

err = Console(stderr=True)
out = Console()


def fail(message: str) -> NoReturn:
    """Print `message` as plain text (paths and shapes like [2, 1] are not rich markup) and exit with code 2."""
    err.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(2)


def new_app(help_text: str | None, summary: str) -> typer.Typer:
    """A Typer app whose commands exit cleanly (partial outputs removed) on SIGTERM."""
    app = typer.Typer(add_completion=False, no_args_is_help=True, help=help_text)

    @app.callback(help=summary)
    def _main() -> None:
        from ikquant.gguf_io import exit_cleanly_on_sigterm

        exit_cleanly_on_sigterm()

    return app
