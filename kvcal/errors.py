"""The one exception type the CLI turns into a one-line message and a non-zero exit."""


class KvcalError(Exception):
    """A user-facing error: bad input, missing data, incompatible artifact, unsupported model.

    The message is printed as is, on one line, so it must say what went wrong and what to do.
    """


def first_line(text: str, limit: int = 300) -> str:
    """The first non-empty line of a message, at most `limit` characters: how other libraries' multi-line errors
    are quoted inside a one-line kvcal message."""
    return (text.strip().splitlines() or [""])[0][:limit]
