"""Every error of ikconvert that means "the checkpoint or the options are at fault" (a one-line message, exit 2).

One module, so that the readers (checkpoint, safetensors, tokenizer, vocabulary) and the architectures raise them
without importing each other. Each is an IkError, which is all the command line catches.
"""

from ikquant.errors import IkError


class ConvertError(IkError, ValueError):
    """Raised when a checkpoint does not convert: names the file, tensor or config key at fault."""


class CheckpointError(IkError, ValueError):
    """Raised when a checkpoint folder cannot be converted as it is (missing files, inconsistent index, bad
    config, a hub reference that cannot be fetched)."""


class SafetensorsError(IkError, ValueError):
    """Raised when a safetensors file is malformed, truncated, or inconsistent with what was asked of it."""


class TokenizerError(IkError, ValueError):
    """Raised when the tokenizer cannot work with a vocabulary (unsupported model or pre-tokenizer type)."""


class VocabError(IkError, ValueError):
    """Raised when tokenizer files cannot be converted (unsupported kind, unknown pre-tokenizer, ids out of
    range)."""
