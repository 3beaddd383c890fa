"""The one base of every error that means "the user's input or options are at fault" (a one-line message, exit 2).

Anything else that escapes a command is a bug and shows its traceback. Classes keep `ValueError` as a second base
where callers catch that.
"""


class IkError(Exception):
    """A mistake in what the user gave: a file, a tensor, an option. Its message names it."""
