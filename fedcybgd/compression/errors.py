"""The one exception type of the codec library."""

from __future__ import annotations


class CodecError(ValueError):
    """A payload or an encode request is malformed; the message names the problem.

    Subclasses ``ValueError`` so callers that already treat bad input as ``ValueError`` keep
    working; decode never lets any other exception type escape for bad bytes.
    """
