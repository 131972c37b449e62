"""Speculative-decoding options shared by every front end (``generate``, ``serve``, the HTTP API).

One place for the names of the ``--spec-type`` values (llama-server's) and for the draft-length
bound, so the CLI parser and the server's per-request ``speculative.n_max`` check cannot drift apart.
"""

from __future__ import annotations

from ..errors import InputError

SPEC_TYPES = ("none", "ngram-simple", "draft-simple", "draft-mtp", "default")
"""Accepted ``--spec-type`` values: no drafting, n-gram prompt lookup, a separate draft model, the MTP
assistant, and ``default``: what gemmaspec ships as best for this model (``draft-mtp`` with the
assistant shipped for it where that was measured faster, else ``ngram-simple``; see
``gemmaspec.loader.drafter_factory``)."""

MAX_DRAFT_TOKENS = 15
"""Largest draft length per round (``--spec-draft-n-max``): a verify forward then runs at most 16
rows, the batch-invariant C kernel's limit (``kernels.SMALL_M``)."""

ACCEPTED_DRAFT_TOKENS = 256
"""Largest ``--spec-draft-n-max`` / ``speculative.n_max`` accepted (llama-server's values, 16 its
default, work unchanged); values above ``MAX_DRAFT_TOKENS`` draft ``MAX_DRAFT_TOKENS``."""


def parse_n_max(value, what: str = "--spec-draft-n-max"):
    """``--spec-draft-n-max`` / ``speculative.n_max`` → int in 0..MAX_DRAFT_TOKENS or ``"auto"``;
    values up to ``ACCEPTED_DRAFT_TOKENS`` (llama-server's range) are taken as ``MAX_DRAFT_TOKENS``.

    Args:
        value: a string from the command line ("3", "auto") or a JSON value (int or "auto").
        what: the option's name, for the error message.

    Raises:
        InputError: not a number nor "auto", or out of range.
    """
    if value == "auto":
        return "auto"
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise InputError(f"{what} must be a number in 0..{ACCEPTED_DRAFT_TOKENS} or 'auto' (got {value!r})")
    try:
        n = int(value)
    except ValueError:
        raise InputError(f"{what} must be a number in 0..{ACCEPTED_DRAFT_TOKENS} or 'auto' (got {value!r})") from None
    if not 0 <= n <= ACCEPTED_DRAFT_TOKENS:
        raise InputError(f"{what} must be in 0..{ACCEPTED_DRAFT_TOKENS} or 'auto' (got {n}); "
                         f"at most {MAX_DRAFT_TOKENS} tokens are drafted per round")
    return min(n, MAX_DRAFT_TOKENS)
