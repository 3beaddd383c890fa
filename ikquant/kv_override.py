"""`--override-kv KEY=TYPE:VALUE`: metadata a user sets in an output, in ik's syntax and with the GGUF types ik
writes (int as INT32, float as FLOAT32, bool, str of at most 127 characters)."""

from __future__ import annotations

from gguf import GGUFValueType

from ikquant.errors import MetadataError
from ikquant.gguf_io import KeyValue

#: ik's override record holds 128 bytes with the terminating zero
MAX_CHARS = 127


def parse_override(text: str) -> KeyValue:
    """One `KEY=TYPE:VALUE` (TYPE: int, float, bool, str) as the key/value it writes."""
    key, sep, rest = text.partition("=")
    if not sep or not key or len(key) > MAX_CHARS:
        raise MetadataError(f"--override-kv {text!r}: expected KEY=TYPE:VALUE with a key of 1 to {MAX_CHARS} "
                            "characters (e.g. general.name=str:My model, tokenizer.ggml.add_bos_token=bool:false)")
    if key.startswith("split.") or key == "general.architecture":
        raise MetadataError(f"--override-kv {text!r}: {key} is written by the tool itself")
    kind, colon, value = rest.partition(":")
    if not colon or kind not in ("int", "float", "bool", "str"):
        raise MetadataError(f"--override-kv {text!r}: the type must be int, float, bool or str (KEY=TYPE:VALUE)")
    try:
        if kind == "int":
            return KeyValue(key, _int32(value), GGUFValueType.INT32)
        if kind == "float":
            return KeyValue(key, float(value), GGUFValueType.FLOAT32)
    except ValueError:
        raise MetadataError(f"--override-kv {text!r}: {value!r} is not {'an int32' if kind == 'int' else 'a float'}"
                            ) from None
    if kind == "bool":
        if value not in ("true", "false"):
            raise MetadataError(f"--override-kv {text!r}: a bool is true or false")
        return KeyValue(key, value == "true", GGUFValueType.BOOL)
    if len(value) > MAX_CHARS:
        raise MetadataError(f"--override-kv {text!r}: a str value holds at most {MAX_CHARS} characters")
    return KeyValue(key, value, GGUFValueType.STRING)


def _int32(value: str) -> int:
    n = int(value.strip(), 10)
    if not -(2**31) <= n < 2**31:
        raise ValueError(value)
    return n
