"""Speculative-decoding options shared by every front end (``generate``, ``serve``, the HTTP API).

One place for the names of the ``--spec-type`` values (llama-server's) and for the draft-length
bound, so the CLI parser and the server's per-request ``speculative.n_max`` check cannot drift apart.
"""

from __future__ import annotations

from ..errors import InputError

SPEC_TYPES = ("none", "ngram-simple", "ngram-mod", "draft-simple", "draft-mtp", "default")
"""Accepted ``--spec-type`` values: no drafting, n-gram prompt lookup, llama.cpp's hash-pool n-gram
drafter (``ngram-mod``), a separate draft model, the MTP assistant, and ``default``: what gemmaspec ships as best for this model (``draft-mtp`` with the
assistant shipped for it where that was measured faster, else ``ngram-simple``; see
``gemmaspec.speculative.plan.plan``)."""

DRAFTLESS_TYPES = ("ngram-simple", "ngram-mod")
"""Types that need no draft model; in a list they come first (llama.cpp's precedence)."""

MODEL_TYPES = ("draft-simple", "draft-mtp")
"""Types that draft with a model (``-md``, or the assistant shipped for the target); one per list."""


def parse_spec_type(value: str | None) -> str | None:
    """``--spec-type`` → its canonical spelling: one of :data:`SPEC_TYPES`, or a list of types joined
    by ``,`` (llama.cpp's comma-separated ``--spec-type``; ``+`` is accepted too, for ``gemmaspec bench``
    whose ``--spec-type`` list measures each entry separately) with at most one model type, put in
    llama.cpp's order: the draftless type first. A list drafts with its first type that proposes
    anything in a round (:class:`gemmaspec.speculative.drafters.ChainDrafter`), as llama-server does
    when a draft model is combined with a draftless type (``docs/speculative.md`` in llama.cpp).

    Raises:
        InputError: an unknown type, ``none``/``default`` in a list, or two model types.
    """
    if value is None:
        return None
    parts = [t.strip() for t in str(value).replace("+", ",").split(",") if t.strip()]
    parts = list(dict.fromkeys(parts))
    bad = [t for t in parts if t not in SPEC_TYPES]
    if bad or not parts:
        raise InputError(f"--spec-type must be one of {', '.join(SPEC_TYPES)}, or a comma-separated list of "
                         f"{', '.join(DRAFTLESS_TYPES + MODEL_TYPES)} (got {value!r})")
    if len(parts) == 1:
        return parts[0]
    alone = [t for t in parts if t in ("none", "default")]
    if alone:
        raise InputError(f"--spec-type {alone[0]} cannot be combined with other types (got {value!r})")
    models = [t for t in parts if t in MODEL_TYPES]
    if len(models) > 1:
        raise InputError(f"--spec-type can combine one model type with n-gram lookup, not {' and '.join(models)} "
                         "(one -md at a time, as llama.cpp)")
    return ",".join([t for t in parts if t in DRAFTLESS_TYPES] + models)


def spec_parts(spec_type: str | None) -> list[str]:
    """The types of a canonical ``--spec-type`` (:func:`parse_spec_type`), in drafting order."""
    return [] if spec_type is None else spec_type.split(",")


def spec_model_type(spec_type: str | None) -> str | None:
    """The model type (``draft-simple``/``draft-mtp``) in a canonical ``--spec-type``, or None."""
    return next((t for t in spec_parts(spec_type) if t in MODEL_TYPES), None)


def check_spec_flags(spec_type: str | None, draft_model: str | None, p_min: float | None) -> str | None:
    """The checks of the speculative flags that need no model: ``--spec-type`` (its canonical spelling
    is returned), ``--spec-draft-p-min`` in [0, 1] (None: the drafter's default), and ``-md`` only
    with a type that drafts with a model (``spec_type`` None: the file's type). The commands run them
    before loading anything, so ``gemmaspec serve`` refuses bad flags before it listens.

    Raises:
        InputError: an unknown type or list, p-min outside [0, 1] (NaN included), or ``-md`` with
            ``none``, ``ngram-simple`` or ``default``.
    """
    spec_type = parse_spec_type(spec_type)
    if p_min is not None and not 0.0 <= p_min <= 1.0:
        raise InputError(f"--spec-draft-p-min must be in [0, 1] (got {p_min})")
    if draft_model and spec_type is not None and spec_model_type(spec_type) is None:
        raise InputError(f"-md is used by --spec-type draft-simple or draft-mtp (alone or after ngram-simple, "
                         f"e.g. ngram-simple,draft-mtp), not {spec_type}")
    return spec_type


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
