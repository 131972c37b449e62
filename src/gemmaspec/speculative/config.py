"""The speculative-decoding settings of one target, as every front end takes them: :class:`SpecConfig`.

``generate``, ``chat``, ``serve``, ``bench``, ``fit`` and ``export`` build one from their flags
(llama-server's names: ``--spec-type``, ``-md``, ``--spec-draft-n-max``, ``--spec-draft-n-min``,
``--spec-draft-p-min``, ``--spec-ngram-size``, ``--spec-ngram-min``) and hand it to
:func:`gemmaspec.speculative.plan.plan`, which decides the drafter. :meth:`SpecConfig.checked` is the
one check of those values that needs no model file.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from ..errors import InputError
from .options import parse_n_max, parse_spec_type, spec_model_type


@dataclass(frozen=True)
class SpecConfig:
    """What the user asked of speculation (before any file is read).

    Attributes:
        type: ``--spec-type`` in its canonical spelling (:func:`~.options.parse_spec_type`): ``none``,
            ``ngram-simple``, ``draft-simple``, ``draft-mtp``, ``default`` or a list such as
            ``ngram-simple,draft-mtp``. None = not given: with ``draft_model`` the file's role decides
            (an assistant drafts as ``draft-mtp``, a model as ``draft-simple``, as llama.cpp), without
            one it is ``default``. The default is speculation on: :func:`~.plan.plan` says what runs.
        draft_model: ``-md``: a path (names are resolved by the front end), or None.
        n_max: most draft tokens per round, 0..15, or ``"auto"`` (adapted per request).
        n_min: proposals shorter than this are not verified (tokens, >= 0).
        p_min: a model drafter's round stops at a draft whose probability is below this, in [0, 1];
            None = the drafter's own (0, or the value measured for an assistant gemmaspec ships).
        ngram_size: longest n-gram the n-gram drafter matches (tokens).
        ngram_min: shortest n-gram that counts (tokens), 1 <= ngram_min <= ngram_size.
        ngram_mod_n_match: tokens the ``ngram-mod`` drafter hashes per entry (llama.cpp's
            ``--spec-ngram-mod-n-match``, default 24), >= 1.
        ngram_mod_n_min: shortest ``ngram-mod`` draft proposed (tokens, >= 1; llama.cpp's
            ``--spec-ngram-mod-n-min``, whose default 48 is for its 64-token drafts).
    """

    type: str | None = None
    draft_model: str | None = None
    n_max: int | str = 3
    n_min: int = 0
    p_min: float | None = None
    ngram_size: int = 4
    ngram_min: int = 1
    ngram_mod_n_match: int = 24
    ngram_mod_n_min: int = 1

    def checked(self) -> SpecConfig:
        """The same settings in canonical form (type spelled as :func:`~.options.parse_spec_type` has
        it, ``n_max`` an int or ``"auto"``), checked. Front ends call it before loading anything, so
        ``gemmaspec serve`` refuses bad flags before it listens.

        Raises:
            InputError: an unknown type or list; ``-md`` with ``none``, ``ngram-simple`` or ``default``;
                ``n_max`` not a number in 0..256 nor ``auto``; ``n_min`` < 0; ``p_min`` outside [0, 1]
                (NaN included); n-gram sizes not 1 <= min <= max.
        """
        spec_type = parse_spec_type(self.type)
        if self.p_min is not None and not (isinstance(self.p_min, (int, float)) and not math.isnan(self.p_min)
                                           and 0.0 <= self.p_min <= 1.0):
            raise InputError(f"--spec-draft-p-min must be in [0, 1] (got {self.p_min})")
        if self.draft_model and spec_type is not None and spec_model_type(spec_type) is None:
            raise InputError(f"-md is used by --spec-type draft-simple or draft-mtp (alone or after ngram-simple, "
                             f"e.g. ngram-simple,draft-mtp), not {spec_type}")
        if self.n_min < 0:
            raise InputError(f"--spec-draft-n-min must be >= 0 (got {self.n_min})")
        if not 1 <= self.ngram_min <= self.ngram_size:
            raise InputError(f"n-gram sizes need 1 <= min <= max (got --spec-ngram-min {self.ngram_min}, "
                             f"--spec-ngram-size {self.ngram_size})")
        if self.ngram_mod_n_match < 1 or self.ngram_mod_n_min < 1:
            raise InputError(f"--spec-ngram-mod-n-match and --spec-ngram-mod-n-min must be >= 1 (got "
                             f"{self.ngram_mod_n_match}, {self.ngram_mod_n_min})")
        return replace(self, type=spec_type, n_max=parse_n_max(self.n_max))
