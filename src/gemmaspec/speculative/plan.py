"""Where the drafter is chosen: :func:`plan` decides, :func:`build` loads.

Every front end (``generate``, ``chat``, ``serve`` and its ``/props``, ``bench``'s in-process target,
``fit``, ``export``, the memory estimate) asks :func:`plan` what a :class:`~.config.SpecConfig` means
for a target file, so they cannot disagree:

- ``--spec-type`` not given and no ``-md``, or ``default``: the speculation gemmaspec ships as fastest
  for this target (``default_spec`` of ``data/assistants.json``: the default model drafts with
  ``ngram-simple,draft-mtp`` and the assistant shipped for it), else ``ngram-simple``. Speculation is
  on unless the user turns it off (``--spec-type none``).
- ``-md`` without ``--spec-type``: the file's role decides, as llama.cpp: an assistant drafts as
  ``draft-mtp``, a model as ``draft-simple``.
- ``draft-mtp`` (alone or in a list) without ``-md``: the assistant shipped for the target, if any.
- p-min: ``--spec-draft-p-min``, else the value measured for the shipped assistant when that is the
  file drafted with, else 0.

:func:`plan` reads file headers only (and remembers which target has a shipped assistant); :func:`build`
loads the draft model or assistant once and returns a :class:`DrafterFactory` that makes one drafter
per KV cache (each served slot needs its own: drafters keep per-request state).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..errors import InputError
from .config import SpecConfig
from .options import spec_model_type, spec_parts

_NEEDS = {"draft-mtp": "the target's assistant: -md ASSISTANT (directory or .gguf)",
          "draft-simple": "a draft model: -md DRAFT.gguf"}


@dataclass(frozen=True)
class DrafterPlan:
    """What runs for one target: decided by :func:`plan`, loaded by :func:`build`.

    Attributes:
        spec: the checked settings this plan answers (``n_max``, ``n_min``, n-gram sizes are its).
        spec_type: the type(s) that draft, canonical: ``none``, ``ngram-simple``, ``draft-simple``,
            ``draft-mtp`` or a list such as ``ngram-simple,draft-mtp`` (never ``default``).
        draft_file: the file the model drafter loads (``-md``, or the assistant shipped for the
            target); None when no type of the plan drafts with a model.
        p_min: the model drafter's p-min in [0, 1] (0.0 without a model drafter).
        shipped: True when ``draft_file`` is the assistant gemmaspec ships for this target.
        why: the measurement behind a shipped default (one line; "" when none), for ``--verbose``.
    """

    spec: SpecConfig
    spec_type: str
    draft_file: str | None = None
    p_min: float = 0.0
    shipped: bool = False
    why: str = ""

    @property
    def model_type(self) -> str | None:
        """``draft-mtp`` or ``draft-simple`` when a model drafts, else None."""
        return spec_model_type(self.spec_type)

    def line(self) -> str:
        """One short sentence for stderr or the log: which drafter, the draft length, and which file."""
        if self.spec_type == "none":
            return "speculation: off"
        text = f"speculation: {self.spec_type}, n-max {self.spec.n_max}"
        if self.spec.n_max == 0:
            text += " (nothing is drafted at draft length 0)"
        if self.draft_file:
            whose = ("the assistant shipped for this model" if self.shipped
                     else "the assistant" if self.model_type == "draft-mtp" else "the draft model")
            text += f", with {whose} ({Path(self.draft_file).name}, p-min {self.p_min:g})"
        return text


def plan(spec: SpecConfig, target_path: str | Path | None) -> DrafterPlan:
    """Decide the drafter for ``spec`` and the target at ``target_path`` (None: the default model)
    without loading weights (headers of ``-md`` only, when its role decides the type).

    Raises:
        InputError: bad settings (:meth:`SpecConfig.checked`), or a model type with no ``-md`` and no
            assistant shipped for the target.
        ModelFileError: an unreadable ``-md`` file (when its role is needed).
    """
    from ..manage.default_model import default_model_path
    from ..manage.shipped import shipped_assistant_entry

    spec = spec.checked()
    target = Path(target_path) if target_path else default_model_path()
    spec_type, draft = spec.type, spec.draft_model
    if spec_type is None and draft:
        from ..manage.fit import read_model

        spec_type = "draft-mtp" if read_model(draft).role == "assistant" else "draft-simple"
    entry = None
    why = ""
    if spec_type in (None, "default"):  # what ships as fastest for this target
        entry = shipped_assistant_entry(target)
        default = (entry or {}).get("default_spec", "ngram-simple")
        why = (entry or {}).get("why", "")
        spec_type = default if entry and "draft-mtp" in spec_parts(default) else "ngram-simple"
    model_type = spec_model_type(spec_type)
    if model_type == "draft-mtp" and not draft:  # the assistant shipped for this target, if any
        entry = entry or shipped_assistant_entry(target)
        draft = entry["path"] if entry else None
    if model_type and not draft:
        raise InputError(f"--spec-type {spec_type} needs {_NEEDS[model_type]}")
    if not model_type:
        return DrafterPlan(spec, spec_type, why=why)
    if entry is None and model_type == "draft-mtp" and spec.p_min is None:
        entry = shipped_assistant_entry(target)  # -md may name the shipped file itself
    shipped = bool(entry and model_type == "draft-mtp"
                   and Path(entry["path"]).resolve() == Path(draft).resolve())
    p_min = spec.p_min if spec.p_min is not None else float(entry.get("p_min", 0.0)) if shipped else 0.0
    return DrafterPlan(spec, spec_type, str(draft), p_min, shipped, why if shipped else "")


class DrafterFactory:
    """Makes a fresh drafter for requests that run in one target KV cache: ``factory(cache)``.

    Attributes:
        plan: the plan it was built from.
        name: the type(s) that draft (``plan.spec_type``).
        p_min: the model drafter's p-min (0.0 without one).
    """

    def __init__(self, plan_: DrafterPlan, make):
        self.plan, self._make = plan_, make
        self.name, self.p_min = plan_.spec_type, plan_.p_min

    def __call__(self, cache):
        """A new :class:`~gemmaspec.speculative.drafters.Drafter` over the target cache ``cache``."""
        return self._make(cache)


def build(plan_: DrafterPlan, engine, warn=None) -> DrafterFactory:
    """Load what ``plan_`` drafts with (a draft model or an assistant, once) for ``engine``.

    Args:
        plan_: from :func:`plan` for ``engine``'s target.
        engine: the target :class:`~gemmaspec.engine.Engine` (its model, tokenizer, context size).
        warn: called with a one-line warning (a QAT target with a non-QAT assistant); None: ignored.

    Raises:
        InputError: a ``-md`` of the wrong role for the type, a target/assistant pair that does not
            match, or a draft model with another vocabulary.
        ModelFileError / UnsupportedArchitectureError: an unreadable draft file.
    """
    from ..loading import load_checkpoint
    from .drafters import (ChainDrafter, DraftModelDrafter, MTPDrafter, NgramDrafter, NgramModDrafter, NgramPool,
                           NoDrafter, check_mtp_pair, check_same_vocabulary)

    spec = plan_.spec
    model_make = None
    if plan_.model_type:
        role = "assistant" if plan_.model_type == "draft-mtp" else "target"
        draft = load_checkpoint(plan_.draft_file, engine.model.device, role=role)
        if role == "assistant":
            assistant = draft.model
            check_mtp_pair(engine.model, assistant)
            warning = qat_mismatch_warning(engine.model, assistant)
            if warning and warn is not None:
                warn(warning)
            model_make = lambda cache: MTPDrafter(assistant, engine.model, cache, plan_.p_min)  # noqa: E731
        else:
            check_same_vocabulary(engine.tokenizer, draft.tokenizer)
            model_make = lambda cache: DraftModelDrafter(draft.model, engine.ctx_size, plan_.p_min)  # noqa: E731

    kinds = spec_parts(plan_.spec_type)
    pool = NgramPool(spec.ngram_mod_n_match) if "ngram-mod" in kinds else None  # shared by every slot

    def one(kind, cache):
        if kind == "none":
            return NoDrafter()
        if kind == "ngram-simple":
            return NgramDrafter(spec.ngram_size, spec.ngram_min)
        if kind == "ngram-mod":
            return NgramModDrafter(pool, spec.ngram_mod_n_min)
        return model_make(cache)

    if len(kinds) == 1:
        return DrafterFactory(plan_, lambda cache: one(kinds[0], cache))
    return DrafterFactory(plan_, lambda cache: ChainDrafter([one(k, cache) for k in kinds]))


def load_drafter(spec: SpecConfig, engine, target_path=None, warn=None):
    """The drafter ``spec`` asks for, for requests run in ``engine``'s own cache: ``build(plan(...))``
    over ``engine.cache``. ``target_path`` None: the engine's own model file.

    Raises:
        as :func:`plan` and :func:`build`.
    """
    path = target_path if target_path is not None else engine.model_path
    return build(plan(spec, path), engine, warn)(engine.cache)


def qat_mismatch_warning(target, assistant) -> str | None:
    """A warning when one of a target/assistant pair is QAT (4-bit grid weights) and the other is not:
    Google's model card pairs QAT targets with QAT assistants only. None when they match."""
    from ..quant.qat import looks_qat

    if getattr(assistant, "token_map", None) is not None:
        return None  # trained by gemmaspec train-drafter against its target: --qat there is about its own export
    name = "blk.0.attn_q.weight"  # every architecture's first query projection (GGUF naming)
    t, a = looks_qat(target.weights[name]), looks_qat(assistant.weights[name])
    if t == a:
        return None
    kind = lambda q: "QAT (4-bit grid)" if q else "non-QAT"  # noqa: E731
    return (f"warning: the target's weights are {kind(t)} but the assistant's are {kind(a)}; Google pairs QAT "
            "targets with QAT assistants (*-qat-q4_0-unquantized-assistant) and acceptance may drop")
