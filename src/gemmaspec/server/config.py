"""``ServeConfig``: what ``gemmaspec serve`` was asked for, as the server's code reads it."""

from __future__ import annotations

from dataclasses import dataclass

from ..sampling import SamplingParams
from .security import MAX_BODY_BYTES


@dataclass
class ServeConfig:
    """What ``gemmaspec serve`` was asked for (see ``gemmaspec serve --help``).

    ``spec_type`` None picks the default: ``--spec-type default`` (for the default model
    ``ngram-simple,draft-mtp`` with the assistant shipped for it, else ``ngram-simple``), or with
    ``draft_model`` ``draft-mtp`` for an assistant checkpoint and ``draft-simple`` for a model; a list
    (``ngram-simple,draft-mtp``) as :func:`~gemmaspec.speculative.options.parse_spec_type`. ``p_min``
    None: the model drafter's own (0.3 for the shipped assistant, else 0; ``/props`` shows the value in
    use). ``n_max`` is an int (0..15) or ``"auto"``.
    ``defaults`` are the sampling settings a request gets for the fields it leaves out (``--temp``,
    ``--seed``...); ``n_predict`` (``-n``) the token limit for every endpoint (None: 16 for
    ``/v1/completions``, no limit for chat and ``/completion``). ``allowed_hosts``, ``cors_origins`` and
    ``max_body`` go to :class:`~gemmaspec.server.security.Guard`. ``slot_save_path``: the directory
    for ``POST /slots/{id}?action=save|restore`` (None: slot actions answer 501). ``alias``: the
    model's names, comma-separated (``/v1/models`` reports the alphabetically first as ``id`` and all
    as ``aliases``, with ``tags``, as llama-server). ``verbose`` (``--verbose``): every OpenAI response
    carries ``__verbose``; ``slots_endpoint`` False (``--no-slots``): ``GET /slots`` answers 501;
    ``metrics_endpoint`` False (``--no-metrics``): ``GET /metrics`` answers 501; ``ui`` False
    (``--no-ui``): ``/`` answers 404. ``chat_template``: Jinja text replacing the model's
    template (``--chat-template``, ``--chat-template-file``).
    """

    model: str | None = None
    draft_model: str | None = None
    spec_type: str | None = None
    n_max: int | str = 3
    n_min: int = 0
    p_min: float | None = None
    ngram_size: int = 4
    ngram_min: int = 1
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

