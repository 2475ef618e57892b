"""The one exception type a user sees: the CLI prints its message as a single line."""


class QliteError(Exception):
    """A user-facing failure. The message names the file or flag at fault."""
