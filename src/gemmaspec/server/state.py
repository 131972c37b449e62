"""The server's state: its settings, the scheduler, the metrics and the loaded model, in one typed
object (:class:`ServerState`) that the routes get through :mod:`.deps`; and loading the model.
"""

from __future__ import annotations

import inspect
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..engine import Engine
from ..errors import InputError
from .apierror import APIError
from .config import ServeConfig
from .metrics import Metrics
from .scheduler import Scheduler

log = logging.getLogger("gemmaspec.server")


@dataclass
class LoadedModel:
    """The model the server runs, as loaded (on the scheduler thread).

    Attributes:
        engine: the engine (tokenizer, model, context size).
        path: the model file.
        spec_type: the speculation in use (``none``, ``ngram-simple``, ``ngram-simple,draft-mtp``...).
        model_id: the name ``/v1/models`` reports: the alphabetically first ``--alias``, else the file name.
        aliases: every ``--alias`` name, sorted.
        p_min: the model drafter's p-min in use (``--spec-draft-p-min``, else the drafter's own, else 0).
        draft_file: the drafter's file (``-md``, or the shipped assistant), None for none.
        load_s: seconds the load took.
        created: when loading finished, Unix seconds (``/v1/models``' ``created``).
        vision: the vision tower (``--mmproj``, a :class:`~gemmaspec.loading.vision.LoadedVision`) or None.
    """

    engine: Engine
    path: Path
    spec_type: str
    model_id: str
    aliases: list[str]
    p_min: float
    draft_file: str | None
    load_s: float
    created: int
    vision: object | None = None


def load_model(cfg: ServeConfig) -> tuple[LoadedModel, Callable]:
    """Load the model and choose its drafter as ``cfg`` says; ``(model, make_drafter)`` where
    ``make_drafter(cache)`` gives a slot its drafter.

    Raises:
        whatever loading raises (:class:`~gemmaspec.errors.GemmaspecError` for a bad file or flag).
    """
    from ..loading.engine import load_engine
    from ..manage.default_model import default_model_path
    from ..speculative.options import MAX_DRAFT_TOKENS
    from ..speculative.plan import build, plan

    t0 = time.perf_counter()
    path = Path(cfg.model) if cfg.model else default_model_path()
    engine = load_engine(path, ctx_size=cfg.ctx_size, device=cfg.device, threads=cfg.threads)
    if cfg.chat_template is not None:
        engine.tokenizer.chat_template = cfg.chat_template
    drafter_plan = plan(cfg.spec, path)
    log.info("%s", drafter_plan.line())
    if drafter_plan.why and cfg.verbose:
        log.info("why: %s", drafter_plan.why)
    from ..manage.catalog import base_model_note, is_base

    if is_base(engine.tokenizer):
        # /props says it too (is_base_model), and the chat page's automatic mode sends text completions then
        log.info("note: %s; the chat page at / sends it text completions (its settings switch to chat)",
                 base_model_note())
    make = build(drafter_plan, engine, warn=log.warning)
    vision = None
    if cfg.mmproj:
        from ..loading.vision import check_pair, load_vision

        vision = load_vision(cfg.mmproj, device=getattr(engine.model, "device", "cpu"))
        check_pair(vision, engine.model.config)
        if "images" not in inspect.signature(engine.model.forward).parameters:
            raise InputError(f"{path} does not take images (Gemma 3 and Gemma 4 targets do); drop --mmproj")
        log.info("vision projector %s: %d tokens per image", vision.path, vision.model.tokens_per_image)
    if drafter_plan.spec_type != "none" and (cfg.choose_n or cfg.spec.n_max == "auto"):
        # the cost model's calibration: a forward over 1..R rows, R up to what a round of every slot
        # drafting n_max tokens runs (16 at most: beyond, the kernel's row blocks repeat)
        n = 8 if cfg.spec.n_max == "auto" else cfg.spec.n_max
        engine.forward_costs(min(MAX_DRAFT_TOKENS, max(8, cfg.n_slots * (1 + n) - 1)))
    aliases = sorted({a.strip() for a in (cfg.alias or "").split(",") if a.strip()})
    model = LoadedModel(engine=engine, path=path, spec_type=drafter_plan.spec_type,
                        model_id=aliases[0] if aliases else path.name, aliases=aliases, p_min=drafter_plan.p_min,
                        draft_file=drafter_plan.draft_file,  # -md, or the shipped assistant
                        load_s=time.perf_counter() - t0, created=int(time.time()), vision=vision)
    return model, make


@dataclass
class ServerState:
    """Everything the routes read: ``cfg`` (the settings), ``scheduler``, ``metrics``, ``started``
    (when the app was created, Unix seconds) and ``model`` (None until the model has loaded)."""

    cfg: ServeConfig
    scheduler: Scheduler
    metrics: Metrics
    started: int
    model: LoadedModel | None = None

    @property
    def engine(self) -> Engine:
        """The loaded model's engine (only once :meth:`require_model` has passed)."""
        return self.model.engine

    def require_model(self) -> None:
        """Raises:
            APIError: 503 ``Loading model`` until the model has loaded (llama-server's answer)."""
        if not self.scheduler.ready.is_set():
            raise APIError(503, "Loading model")


def new_state(cfg: ServeConfig, on_ready=None, on_load_error=None) -> ServerState:
    """The state of a new server: its scheduler (not started) loads the model with :func:`load_model`
    and logs one line when it is ready; ``on_ready()`` / ``on_load_error(exc)`` are called after it
    (on the scheduler thread)."""
    st: ServerState

    def load():
        st.model, make = load_model(cfg)
        return st.model.engine, make

    def ready():
        from .. import kernels
        from ..speculative.options import spec_model_type

        m = st.model
        log.info("model %s loaded in %.2f s: context %d, %d slots, speculative %s (n_max %s%s)%s%s%s",
                 m.model_id, m.load_s, m.engine.ctx_size, cfg.n_slots, m.spec_type, cfg.spec.n_max,
                 f", p_min {m.p_min:g}" if spec_model_type(m.spec_type) else "",
                 ", each round's draft length chosen per slot from measured costs, up to n_max"
                 if cfg.choose_n and m.spec_type != "none" else "",
                 "; int8 activations (--act-quant q8_0, or auto for a model this size)" if kernels.act_quant() == "q8_0"
                 else "; int8 activations in the head and layers (--act-quant auto for a model this size)"
                 if getattr(getattr(m.engine.model, "head", None), "auto_q8", False) else "",
                 "" if scheduler.batched else "; this model has no batched forward, slots take turns")
        if on_ready:
            on_ready()

    metrics = Metrics(running=lambda: scheduler.running(), waiting=lambda: scheduler.queued())
    scheduler = Scheduler(load, cfg.n_slots, metrics, on_ready=ready, on_load_error=on_load_error)
    st = ServerState(cfg, scheduler, metrics, started=int(time.time()))
    return st
