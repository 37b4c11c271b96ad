"""Errors the library raises for bad requests (a leaf module: everything may import it)."""


class RequestError(ValueError):
    """A malformed generation request or engine setting; the message names the field."""
