"""The one exception type of the codec package.

``CodecError`` subclasses ``ValueError`` so callers that validate user input generically still catch it.
Every failure that untrusted bytes or a bad codec spec can cause is reported as a ``CodecError``;
anything else escaping ``decode`` is a bug.
"""

from __future__ import annotations

__all__ = ["CodecError"]


class CodecError(ValueError):
    """Bytes that are not a valid encoded tensor, a tensor a codec cannot encode, or a bad codec spec."""
