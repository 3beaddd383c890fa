"""What the three command-line tools share: their consoles, the error exit and the Typer app they start from."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import typer
from rich.console import Console
from rich.markup import escape
from typer.models import CommandFunctionType

if TYPE_CHECKING:
    from ikquant.split_layout import SplitLimits

err = Console(stderr=True)
out = Console()

# the output options ikconvert and ikquant share
SPLIT_MAX_SIZE = typer.Option(None, "--split-max-size", help="Split the output into shards of at most this much "
                              "tensor data (48G = 48e9 bytes, as mainline's converter reads it; 45GiB also works): "
                              "OUT-00001-of-0000N.gguf ...")
SPLIT_MAX_TENSORS = typer.Option(0, "--split-max-tensors", help="Split the output into shards of at most this many "
                                 "tensors.")
NO_TENSOR_FIRST_SPLIT = typer.Option(False, "--no-tensor-first-split", help="Split with a first shard that holds the "
                                     "metadata alone (a chat-template fix rewrites a small file).")
# the mix constraints ikquant --sweep and ikrun mix share (ikquant/mix_constraints.py)
TIE = typer.Option([], "--tie", help="Repeatable REGEX: the swept tensors of one layer that it matches get one type "
                   "(e.g. 'attn_(k_b|v_b)'; tensors of different row lengths cannot be tied). ffn_up_exps and "
                   "ffn_gate_exps are tied by default (ik's fused MoE kernels).")
NO_DEFAULT_TIES = typer.Option(False, "--no-default-ties", help="Do not tie ffn_up_exps with ffn_gate_exps.")
MIN_TYPE = typer.Option([], "--min-type", help="Repeatable REGEX=TYPE: the swept tensors it matches get no type "
                        "of fewer bits per weight than TYPE (e.g. 'ffn_.*_exps=IQ2_KS'; the first match applies).")
MTP_SWEEP = typer.Option(None, "--mtp-sweep", help="An `ikrun sweep T --metric acceptance --mtp` result: type the "
                         "model's NextN/MTP head from it within --max-acceptance-loss (the rest of the file as without "
                         "it; the head's bits count as fixed in a --sweep mix).")
MAX_ACCEPTANCE_LOSS = typer.Option(None, "--max-acceptance-loss", help="With --mtp-sweep: the most mean acceptance "
                                   "length (tokens per target step) the head's types may lose, predicted as the sum of "
                                   "its tensors' measured losses; the head gets the fewest bits within it.")
OVERRIDE_KV = typer.Option([], "--override-kv", help="KEY=TYPE:VALUE (TYPE int, float, bool or str; repeatable): set "
                           "a metadata key in the output, as ik's --override-kv.")


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


def print_shard_plan(path: Path, sizes: list[int], limits: SplitLimits) -> None:
    """What a split output would be (--dry-run): each shard's name, tensor count and size."""
    from ikquant.split_layout import shard_plan

    if not limits.splits:
        return
    for shard, n, nbytes in shard_plan(path, sizes, limits):
        out.print(f"  {shard}: {n} tensors, {nbytes / 2**20:.2f} MiB", highlight=False)


def report_outputs(outputs: list[Path], kept: list[Path]) -> None:
    """Name the shards of a split output, and those left as they were."""
    if len(outputs) < 2 and not kept:
        return
    for path in outputs:
        err.print(f"  {path}: " + ("unchanged, left as it was" if path in kept else "written"), highlight=False)


def new_app(help_text: str | None, summary: str, ordinary_pages: bool = False) -> typer.Typer:
    """A Typer app (App) whose commands exit cleanly (partial outputs removed) on SIGTERM and keep the memory they
    free (ikquant/heap.py); with `ordinary_pages`, without numpy's huge-page advice (heap.no_huge_page_advice)."""
    app = App(add_completion=False, no_args_is_help=True, help=help_text)

    @app.callback(help=summary)
    def _main() -> None:
        from ikquant.gguf_io import exit_cleanly_on_sigterm
        from ikquant.heap import no_huge_page_advice, retain_freed_memory

        exit_cleanly_on_sigterm()
        retain_freed_memory()
        if ordinary_pages:
            no_huge_page_advice()

    return app
