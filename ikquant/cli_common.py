"""What the three command-line tools share: their consoles, the error exit and the Typer app they start from."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NoReturn

import typer
from rich.console import Console
from rich.markup import escape
from typer.models import CommandFunctionType

err = Console(stderr=True)
out = Console()


def fail(message: str) -> NoReturn:
    """Print `message` as plain text (paths and shapes like [2, 1] are not rich markup) and exit with code 2."""
    err.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(2)


class App(typer.Typer):
    """A Typer app whose commands turn the operating-system errors a user can act on (no space, no permission, no
    such folder, a read-only file system) into one-line messages; any other error keeps its traceback."""

    def command(self, name: str | None = None, **kwargs: Any) -> Callable[[CommandFunctionType], CommandFunctionType]:
        register = super().command(name, **kwargs)

        def decorator(f: CommandFunctionType) -> CommandFunctionType:
            register(_os_errors_as_messages(f))
            return f

        return decorator


def _os_errors_as_messages(f: Callable[..., Any]) -> Callable[..., Any]:
    from ikquant.outputs import os_error_message

    @functools.wraps(f)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return f(*args, **kwargs)
        except OSError as exc:
            message = os_error_message(exc)
            if message is None:
                raise
            fail(message)

    return wrapper


def new_app(help_text: str | None, summary: str) -> typer.Typer:
    """A Typer app (App) whose commands exit cleanly (partial outputs removed) on SIGTERM."""
    app = App(add_completion=False, no_args_is_help=True, help=help_text)

    @app.callback(help=summary)
    def _main() -> None:
        from ikquant.gguf_io import exit_cleanly_on_sigterm

        exit_cleanly_on_sigterm()

    return app
