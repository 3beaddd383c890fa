"""Every error of ikquant that means "the user's input or options are at fault" (a one-line message, exit 2).

They live in this one module so that any module can raise them without importing the module that owns the work
(quantize, recipes, gguf_io, ...), which is what made those modules import each other. Anything else that escapes a
command is a bug and shows its traceback. Classes keep `ValueError` (or the builtin a caller catches) as a second
base where callers catch that.
"""


class IkError(Exception):
    """A mistake in what the user gave: a file, a tensor, an option. Its message names it."""


class InputNotFoundError(IkError, FileNotFoundError):
    """Raised when an input the user named (a GGUF, an imatrix, a sweep, a checkpoint folder or shard) does not
    exist."""


class CodecMissingError(IkError, NotImplementedError):
    """Raised when a type is asked to quantize or dequantize and iktools has no codec for it."""


class UnknownTypeError(IkError, ValueError):
    """Raised for a type name or id that ik_llama.cpp does not define (or that we cannot size)."""


class UnknownFileTypeError(IkError, ValueError):
    """Raised for a file type (--type, a GGUF's general.file_type) that ik_llama.cpp does not define."""


class GGUFFormatError(IkError, ValueError):
    """Raised when a file is not a readable GGUF (bad magic, truncated, inconsistent tensor table, missing key)."""


class InputChangedError(IkError, ValueError):
    """Raised when an input file changed on disk (truncated, rewritten, replaced, removed) while being read."""


class QuantInputError(IkError, ValueError):
    """Raised for input that no quantizer can represent correctly (NaN/Inf, wrong shape, wrong row length)."""


class QuantizeError(IkError, ValueError):
    """Raised when a quantization cannot proceed as asked (names the tensor or option at fault)."""


class MainlineError(IkError, ValueError):
    """Raised for what `--recipe mainline` cannot write: an ik-only file type or tensor type, an ik-only option."""


class RepackError(IkError, ValueError):
    """Raised when a repack cannot be done as asked (a bad pattern, the input as the output)."""


class ImatrixError(IkError, ValueError):
    """Raised when an importance-matrix file cannot be read or does not fit the model."""


class SweepFileError(IkError, ValueError):
    """Raised when a sweep file cannot be read, or its rows were measured on something else than this run."""


class MixError(IkError, ValueError):
    """Raised when a sweep cannot serve this model or budget."""


class SizeError(IkError, ValueError):
    """Raised when a size (--mem, --target-size, a budget) does not parse, or is not positive."""


class OutputError(IkError, ValueError):
    """Raised when an output cannot be written: no room, no permission, no such folder, a read-only file system."""


class ClusterError(IkError, ValueError):
    """Raised when --ray cannot be used: Ray is not installed, the address is malformed or does not answer."""


class SplitError(IkError, ValueError):
    """Raised when an output cannot be split as asked (a size limit below a tensor's size, a layout that does not
    fit)."""


class MetadataError(IkError, ValueError):
    """Raised for metadata a user gives that cannot be written (an --override-kv that does not parse), or a key a
    command needs that a file lacks (a model card for a file without a file type)."""
