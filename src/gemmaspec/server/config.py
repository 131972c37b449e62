"""``ServeConfig``: what ``gemmaspec serve`` was asked for, as the server's code reads it."""

from __future__ import annotations

from dataclasses import dataclass

from ..sampling import SamplingParams
from ..speculative.config import SpecConfig
from .security import MAX_BODY_BYTES


@dataclass
class ServeConfig:
    """What ``gemmaspec serve`` was asked for (see ``gemmaspec serve --help``).

    ``spec``: the speculative settings (``--spec-type``, ``-md``, ``--spec-draft-*``, ``--spec-ngram-*``)
    as every front end has them; :func:`gemmaspec.speculative.plan.plan` decides the drafter from them
    when the model loads (type None: the default speculation for the model). ``spec.n_max`` and
    ``spec.n_min`` are also the defaults of a request's ``speculative.n_max`` / ``n_min``. ``choose_n``
    (default; ``--spec-draft-n-fixed`` turns it off): ``n_max`` is an upper bound and each round's draft
    length is chosen per slot for the whole batch from measured costs (a request's
    ``speculative.n_fixed: true`` drafts its ``n_max`` every round instead).
    ``defaults`` are the sampling settings a request gets for the fields it leaves out (``--temp``,
    ``--seed``...); ``n_predict`` (``-n``) the token limit for every endpoint (None: 16 for
    ``/v1/completions``, no limit for chat and ``/completion``). ``allowed_hosts``, ``cors_origins`` and
    ``max_body`` go to :class:`~gemmaspec.server.security.Guard`. ``slot_save_path``: the directory
    for ``POST /slots/{id}?action=save|restore`` (None: slot actions answer 501). ``alias``: the
    model's names, comma-separated (``/v1/models`` reports the alphabetically first as ``id`` and all
    as ``aliases``, with ``tags``, as llama-server). ``verbose`` (``--verbose``): every OpenAI response
    carries ``__verbose``, and the start logs why the default speculation was chosen;
    ``slots_endpoint`` False (``--no-slots``): ``GET /slots`` answers 501; ``metrics_endpoint`` False
    (``--no-metrics``): ``GET /metrics`` answers 501; ``ui`` False (``--no-ui``): ``/`` answers 404.
    ``chat_template``: Jinja text replacing the model's template (``--chat-template``,
    ``--chat-template-file``). ``mmproj``: the vision projector (``--mmproj``: an mmproj GGUF or a
    multimodal checkpoint directory), None for text only; ``allow_image_urls``
    (``--allow-image-urls``): ``image_url`` parts may carry ``http(s)`` URLs, which the server fetches.
    """

    model: str | None = None
    spec: SpecConfig = SpecConfig()
    ctx_size: int | None = None
    n_slots: int = 4
    device: str = "auto"
    threads: int | None = None
    api_key: str | None = None
    alias: str | None = None
    defaults: SamplingParams = SamplingParams()
    n_predict: int | None = None
    allowed_hosts: tuple[str, ...] = ()
    cors_origins: tuple[str, ...] = ()
    max_body: int = MAX_BODY_BYTES
    slot_save_path: str | None = None
    verbose: bool = False
    slots_endpoint: bool = True
    metrics_endpoint: bool = True
    ui: bool = True
    tags: tuple[str, ...] = ()
    chat_template: str | None = None
    context_shift: bool = False
    n_keep: int = 0
    mmproj: str | None = None
    allow_image_urls: bool = False
    choose_n: bool = True

