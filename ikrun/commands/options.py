"""The options every evaluating `ikrun` command shares, declared once and added to each command by one decorator.

`@evaluation_options` adds --threads, --kv-cache, --cache-type-k/-ctk, --cache-type-v/-ctv, -khad/-vhad, -ictk, --mem, --stream/--no-stream, --spill-dir and one option per
RuntimeOptions field (their help and flag come from the field's metadata; a bool is a flag, an int takes a value)
to a command's signature, and hands the command one `Evaluation` in their place. A new runtime option is a field
of RuntimeOptions and nothing else here.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Optional

import typer

from ikrun.options import RuntimeOptions


class OnOff(str, Enum):
    on = "on"
    off = "off"


KV_HELP = ("KV cache precision: f32 (default) measures the weights alone; f16 rounds K/V as ik's default cache "
           "does, to reproduce ik's own numbers; k-f32 rounds V alone, as ik's -ctk f32 (its values stay F16 "
           "without flash attention).")
CTK_HELP = ("K cache type as ik's -ctk names it (f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1, q6_0, iq4_nl; ik's "
             "q8_KV is refused): the keys are written with ik's cache quantizer and read back exactly. Overrides "
             "--kv-cache for K. On DeepSeek's MLA models it sets the latent cache.")
CTV_HELP = ("V cache type as ik's -ctv names it (the -ctk types; ik itself needs flash attention for one other than "
            "f16 or bf16; --numerics ik-avx2 reproduces q8_0, q6_0, q4_0, q4_1 and iq4_nl values in ik's own "
            "flash-attention kernel; on DeepSeek's MLA, without flash attention, -ctv sets the latent cache, as in "
            "ik). Overrides --kv-cache for V.")
KHAD_HELP = ("ik's -khad: rotate keys (and queries) by a Hadamard transform over blocks of each head (of 64 values of "
             "an MLA latent row) around a quantized K cache; dropped for an unquantized one, as ik drops it.")
VHAD_HELP = "ik's -vhad: the same for the values around a quantized V cache."
ICTK_HELP = ("DSA indexer key cache type as ik's -ictk names it (glm-dsa: the -ctk types, its keys Hadamard-rotated "
             "first as ik rotates them; openpangu: f32, f16, bf16, q8_0). Default: f16, ik's default, unless the K "
             "cache is f32.")
MEM_HELP = ("Memory budget for everything the run holds (decoded weights, hidden states, caches, logits), e.g. 8GiB "
            "or 512MiB. Default: 75% of the memory available at start-up.")
STREAM_HELP = ("Layer-streamed evaluation: all chunks through block 0, then block 1, ..., each block's weights read "
               "once. Default: streamed for one-pass runs over several chunks and whenever the decoded model does "
               "not fit --mem; --no-stream runs chunk by chunk.")
SPILL_HELP = "Folder for the spill file of streamed hidden states that do not fit --mem (default: the temp folder)."


@dataclass(frozen=True)
class Evaluation:
    """What the shared options say: how to load and run the model."""

    threads: int | None
    kv_cache: str
    mem: str | None
    stream: bool | None
    spill_dir: Path | None
    options: RuntimeOptions
    cache_type_k: str | None = None
    cache_type_v: str | None = None
    k_cache_hadamard: bool = False
    v_cache_hadamard: bool = False
    indexer_cache_type_k: str | None = None


def _runtime_parameters() -> list[inspect.Parameter]:
    params = []
    annotation: Any
    for f in dataclasses.fields(RuntimeOptions):
        flag, help_text = "--" + f.name.replace("_", "-"), f.metadata["help"]
        if f.default is None:  # tri-state: unset keeps the architecture's default
            option, annotation = typer.Option(None, flag, case_sensitive=False, help=help_text), Optional[OnOff]
        elif "choices" in f.metadata:
            choice = Enum(f.name.title(), {c: c for c in f.metadata["choices"]}, type=str)  # type: ignore[misc]
            option, annotation = typer.Option(f.default, flag, case_sensitive=False, help=help_text), choice
        else:
            option, annotation = typer.Option(f.default, flag, help=help_text), type(f.default)
        params.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=annotation))
    return params


def _shared_parameters() -> list[inspect.Parameter]:
    kw = inspect.Parameter.KEYWORD_ONLY
    return [
        inspect.Parameter("threads", kw, annotation=Optional[int],
                          default=typer.Option(None, "--threads", "-t", help="Worker threads (default: all cores).")),
        inspect.Parameter("kv_cache", kw, annotation=str, default=typer.Option("f32", "--kv-cache", help=KV_HELP)),
        inspect.Parameter("cache_type_k", kw, annotation=Optional[str],
                          default=typer.Option(None, "--cache-type-k", "-ctk", help=CTK_HELP)),
        inspect.Parameter("cache_type_v", kw, annotation=Optional[str],
                          default=typer.Option(None, "--cache-type-v", "-ctv", help=CTV_HELP)),
        inspect.Parameter("k_cache_hadamard", kw, annotation=bool,
                          default=typer.Option(False, "--k-cache-hadamard", "-khad", help=KHAD_HELP)),
        inspect.Parameter("v_cache_hadamard", kw, annotation=bool,
                          default=typer.Option(False, "--v-cache-hadamard", "-vhad", help=VHAD_HELP)),
        inspect.Parameter("indexer_cache_type_k", kw, annotation=Optional[str],
                          default=typer.Option(None, "--indexer-cache-type-k", "-ictk", help=ICTK_HELP)),
        inspect.Parameter("mem", kw, annotation=Optional[str], default=typer.Option(None, "--mem", help=MEM_HELP)),
        inspect.Parameter("stream", kw, annotation=Optional[bool],
                          default=typer.Option(None, "--stream/--no-stream", help=STREAM_HELP)),
        inspect.Parameter("spill_dir", kw, annotation=Optional[Path],
                          default=typer.Option(None, "--spill-dir", help=SPILL_HELP)),
        *_runtime_parameters(),
    ]


def _option_value(f: dataclasses.Field, value: Any) -> Any:  # type: ignore[type-arg]
    """A RuntimeOptions field's value from its CLI option (on/off options of None-defaulted fields become bools)."""
    if f.default is None:
        return None if value is None else value == OnOff.on
    return value.value if isinstance(value, Enum) else value


def evaluation_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """Replace the command's `ev: Evaluation` parameter by the shared options."""
    sig = inspect.signature(command)
    own = [p for name, p in sig.parameters.items() if name != "ev"]
    shared = _shared_parameters()
    names = {p.name for p in shared}

    @functools.wraps(command)
    def wrapper(**kwargs: Any) -> Any:
        given = {k: kwargs.pop(k) for k in list(kwargs) if k in names}
        runtime: dict[str, Any] = {f.name: _option_value(f, given[f.name]) for f in dataclasses.fields(RuntimeOptions)}
        ev = Evaluation(given["threads"], given["kv_cache"], given["mem"], given["stream"], given["spill_dir"],
                        RuntimeOptions(**runtime), given["cache_type_k"], given["cache_type_v"],
                        given["k_cache_hadamard"], given["v_cache_hadamard"], given["indexer_cache_type_k"])
        return command(**kwargs, ev=ev)

    wrapper.__signature__ = sig.replace(parameters=[  # type: ignore[attr-defined]
        *(p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own), *shared])
    wrapper.__annotations__ = {p.name: p.annotation for p in [*own, *shared]}
    return wrapper
