"""The ``gemmaspec serve`` command: flags (llama-server's names) and startup.

The socket is bound first (so a busy port is a one-line error), then uvicorn starts answering and
the ``listening on`` line is printed (``/health`` says 503 while the model loads on the scheduler
thread, then 200). A model that fails to load ends the server with ``error: ...`` and exit status 1.
``--verbose`` adds the memory estimate and why the default speculation was chosen.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from pathlib import Path

from ..errors import InputError, ModelFileError
from .args import (add_common, add_spec, memory_estimate, read_target, refuse, sampling_params, seed_arg,
                   setup_logging, spec_plan)

CHOSEN_N_MAX = 8
"""``--spec-draft-n-max`` of ``serve`` when not given and the draft length is chosen per round (measured:
at one user as good as ``auto``, whose cap this is; at four users drafting less by itself, docs/server.md)."""

LLAMA_FLAGS_REFUSED_SERVE = {
    ("-cb", "--cont-batching", "-nocb", "--no-cont-batching"): "the -np slots are always batched together",
}


def add_parser(sub) -> argparse.ArgumentParser:
    """Register ``serve`` on the ``gemmaspec`` subparsers."""
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (llama-server's API), several users at once",
                       allow_abbrev=False)
    add_common(s)
    s.add_argument("-np", "--parallel", type=int, default=4,
                   help="slots: requests served at once, batched together (default 4); more wait in a queue")
    s.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1); several, comma-separated, all on the same port")
    s.add_argument("--port", type=int, default=8085, help="port (default 8085; 0 picks a free one)")
    s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on the API endpoints")
    s.add_argument("-a", "--alias", default=None,
                   help="model name(s) clients use, comma-separated (default: the model's file name); /v1/models "
                        "reports the alphabetically first as id and all as aliases")
    s.add_argument("--tags", default=None, help="comma-separated tags /v1/models reports for the model")
    s.add_argument("--chat-template", default=None, metavar="NAME|JINJA",
                   help="chat template instead of the model's: a name (" + ", ".join(TEMPLATES) + ") or Jinja text")
    s.add_argument("--chat-template-file", default=None, metavar="FILE", help="chat template (Jinja) from a file")
    s.add_argument("--mmproj", default=None, metavar="FILE",
                   help="the model's vision projector (an mmproj GGUF, or the multimodal checkpoint directory; "
                        "Gemma 3): chat requests may then carry image_url parts with data URLs, and /completion "
                        "prompts multimodal_data")
    s.add_argument("--allow-image-urls", action="store_true",
                   help="with --mmproj: fetch image_url parts' http(s) URLs (10 s timeout, 10 MiB cap; the server "
                        "fetches whatever its network reaches: only for trusted clients). Default: data URLs only")
    s.add_argument("--slots", dest="slots_endpoint", action="store_true", default=True,
                   help="answer GET /slots (the default)")
    s.add_argument("--no-slots", dest="slots_endpoint", action="store_false", help="GET /slots answers 501")
    s.add_argument("--metrics", dest="metrics", action="store_true", default=True,
                   help="answer GET /metrics (the default; llama-server's flag to enable it)")
    s.add_argument("--no-metrics", dest="metrics", action="store_false", help="GET /metrics answers 501")
    s.add_argument("--no-ui", "--no-webui", dest="ui", action="store_false", default=True,
                   help="no chat page: / answers 404")
    s.add_argument("--verbose", action="store_true",
                   help="every OpenAI response carries __verbose (llama-server's native result, with the rendered "
                        "prompt); the start also logs the memory estimate and why the default speculation was chosen")
    s.add_argument("--allowed-hosts", action="append", default=[], metavar="NAMES",
                   help="Host names the server answers to besides IP addresses and localhost (comma-separated, "
                        "repeatable; '*' for any): a guard against DNS rebinding")
    s.add_argument("--cors-origin", "--cors-origins", dest="cors_origin", action="append", default=[],
                   metavar="ORIGINS", help="origins (https://app.example) whose pages may call the API cross-origin "
                                           "(comma-separated, repeatable; '*' for any); default none")
    s.add_argument("--slot-save-path", default=None, metavar="DIR",
                   help="directory for POST /slots/ID?action=save|restore (a slot's prompt cache to a file and "
                        "back; created if missing); default none: slot actions answer 501")
    d = s.add_argument_group("defaults for requests that leave them out (llama-server's flags)")
    d.add_argument("-n", "--n-predict", type=int, default=None,
                   help="token limit (default: 16 on /v1/completions, none on chat and /completion; -1 = none)")
    d.add_argument("--temp", type=float, default=None, help="temperature (default 0.8)")
    d.add_argument("--top-k", type=int, default=None, help="top-k (default 40; 0 or below = off)")
    d.add_argument("--top-p", type=float, default=None, help="top-p (default 0.95)")
    d.add_argument("--min-p", type=float, default=None, help="min-p (default 0.05)")
    d.add_argument("--repeat-penalty", type=float, default=None, help="repetition penalty (default 1.0)")
    d.add_argument("-s", "--seed", type=seed_arg, default=None,
                   help="seed (default -1: a random seed per request); any integer, wrapped to 32 bits as llama.cpp does")
    add_spec(s)
    s.add_argument("--spec-draft-n-fixed", action="store_true",
                   help="draft --spec-draft-n-max tokens every round, as llama-server does (default: each round's draft "
                        "length is chosen per slot, 0 included, from measured costs, up to --spec-draft-n-max, "
                        "which is then 8 unless given)")
    refuse(s, LLAMA_FLAGS_REFUSED_SERVE)
    return s


# llama-server's --chat-template names gemmaspec knows (Jinja of the same formats; a Gemma model's
# vocabulary has none of the other formats' control tokens, so they are written as text)
TEMPLATES = {
    "gemma": None,  # the built-in Gemma turn format
    "chatml": "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
              "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}",
    "llama3": "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
              "'<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
              "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}",
    "command-r": "{% for message in messages %}{{ '<|START_OF_TURN_TOKEN|>' + {'system': '<|SYSTEM_TOKEN|>', 'user': "
                 "'<|USER_TOKEN|>', 'assistant': '<|CHATBOT_TOKEN|>'}.get(message['role'], '<|USER_TOKEN|>') + "
                 "message['content'] + '<|END_OF_TURN_TOKEN|>' }}{% endfor %}{% if add_generation_prompt %}"
                 "{{ '<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>' }}{% endif %}",
}


def chat_template_of(args) -> str | None:
    """The Jinja text of ``--chat-template`` / ``--chat-template-file`` (None: the model's own).

    Raises:
        InputError: both given, an unknown name that is not Jinja, an unreadable file, a template
            that does not parse.
    """
    name, path = args.chat_template, args.chat_template_file
    if name is not None and path is not None:
        raise InputError("give --chat-template or --chat-template-file, not both")
    if path is not None:
        try:
            text = Path(path).read_text("utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise InputError(f"--chat-template-file {path}: cannot read it ({getattr(exc, 'strerror', None) or exc})") \
                from None
    elif name is None:
        return None
    elif name in TEMPLATES:
        if TEMPLATES[name] is None:
            from ..tokenizer import GEMMA_CHAT_TEMPLATE

            return GEMMA_CHAT_TEMPLATE
        return TEMPLATES[name]
    elif "{%" in name or "{{" in name:
        text = name
    else:
        raise InputError(f"--chat-template {name}: unknown template name; use one of {', '.join(TEMPLATES)}, Jinja "
                         "text, or --chat-template-file FILE")
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        from ..tokenizer import template_extensions

        ImmutableSandboxedEnvironment(extensions=list(template_extensions())).parse(text)
    except jinja2.TemplateError as exc:
        raise InputError(f"the chat template does not parse: {exc}") from None
    return text


def _check_readable(flag: str, path: str | None) -> None:
    """Fail before the server announces itself when a model path given on the command line cannot be
    read (the model itself loads later, on the scheduler thread).

    Raises:
        ModelFileError: the path does not exist or is not readable.
    """
    if path is None:
        return
    p = Path(path)
    if not p.exists():
        raise ModelFileError(f"model file not found: {p} ({flag})")
    if not os.access(p, os.R_OK) or (p.is_dir() and not os.access(p, os.X_OK)):
        raise ModelFileError(f"model file not readable: {p} ({flag}); check its permissions")


def _announcing_server(uvicorn):
    """A ``uvicorn.Server`` class that prints one line on stderr once it serves its sockets (after its
    startup: the app's lifespan has begun and every socket has its server), not before: a client that
    reads the line and connects gets an answer at once."""

    class AnnouncingServer(uvicorn.Server):
        def __init__(self, config, line: str):
            super().__init__(config)
            self.line = line

        async def startup(self, sockets=None):
            await super().startup(sockets=sockets)
            if self.started:
                print(self.line, file=sys.stderr, flush=True)

    return AnnouncingServer


def serve(args) -> int:
    """Run the server until interrupted. Returns the exit status.

    Raises:
        InputError: bad flag values, or the address cannot be bound.
    """
    import uvicorn

    from ..server.api import ServeConfig, create_app

    if args.parallel < 1:
        raise InputError(f"-np must be at least 1 (got {args.parallel})")
    if not 0 <= args.port <= 65535:
        raise InputError(f"--port must be in 0..65535 (got {args.port})")
    if args.spec_draft_n_max is None and not args.spec_draft_n_fixed:
        # the bound of the length chosen each round: the adaptive length's cap (the catalog's lengths are
        # fixed ones'); one user drafts long where it pays, the batch's choice keeps load in check
        args.spec_draft_n_max = str(CHOSEN_N_MAX)
    drafter_plan = spec_plan(args)  # bad speculative flags are refused before listening
    if args.api_key is not None and not args.api_key.strip():
        raise InputError("--api-key must not be empty")
    for flag, path in (("-m", args.model), ("-md", args.model_draft)):
        _check_readable(flag, path)
    read_target(args.model)  # an assistant as -m is refused before listening
    # the slots' caches, plus the engine's own (allocated, never written by serve: it costs device memory
    # on CUDA, not resident memory on the CPU)
    est = memory_estimate(args, drafter_plan, args.parallel, args.parallel + (1 if args.device == "cuda" else 0))
    defaults = sampling_params(args, server=True)
    slot_dir = None
    if args.slot_save_path:
        slot_dir = Path(args.slot_save_path)
        try:
            slot_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise InputError(f"--slot-save-path {slot_dir}: cannot create it ({exc.strerror or exc})") from None
        slot_dir = str(slot_dir)
    split = lambda vals: tuple(x.strip() for v in vals for x in v.split(",") if x.strip())  # noqa: E731
    from ..server.security import host_names, normalize_origin

    binds = [h.strip().strip("[]") for h in args.host.split(",") if h.strip()]
    if not binds:
        raise InputError("--host needs an address")
    bad = [h for h in split(args.allowed_hosts) if "/" in h or "@" in h]
    if bad:
        raise InputError(f"--allowed-hosts takes host names as a Host header carries them (box.example or "
                         f"box.example:8085), not {bad[0]!r}")
    hosts = tuple(n for b in binds for n in host_names(b, split(args.allowed_hosts)))  # IPs, localhost pass
    cfg = ServeConfig(model=args.model, spec=drafter_plan.spec, ctx_size=args.ctx_size, n_slots=args.parallel,
                      device=args.device, threads=args.threads, api_key=args.api_key, alias=args.alias,
                      defaults=defaults, n_predict=args.n_predict, allowed_hosts=hosts,
                      cors_origins=tuple(normalize_origin(o) for o in split(args.cors_origin)), slot_save_path=slot_dir, verbose=args.verbose,
                      slots_endpoint=args.slots_endpoint, metrics_endpoint=args.metrics, ui=args.ui, tags=split([args.tags or ""]),
                      chat_template=chat_template_of(args), context_shift=args.context_shift, n_keep=args.keep,
                      mmproj=args.mmproj, allow_image_urls=args.allow_image_urls,
                      choose_n=not args.spec_draft_n_fixed)
    setup_logging(timestamps=True)
    socks: list[socket.socket] = []
    port = args.port
    for bind in binds:  # the first fixes the port (--port 0: a free one), the others share it
        family = socket.AF_INET6 if ":" in bind else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        try:
            sock.bind((bind, port))
        except OSError as exc:
            for s_ in [*socks, sock]:
                s_.close()
            raise InputError(f"cannot listen on {bind}:{port} ({exc.strerror or exc}); "
                             "pick another --port or --host") from None
        sock.listen(128)
        port = sock.getsockname()[1]
        socks.append(sock)
    failure: list[BaseException] = []
    server: uvicorn.Server | None = None

    def load_failed(exc: BaseException) -> None:
        failure.append(exc)
        if server is not None:
            server.should_exit = True

    app = create_app(cfg, on_load_error=load_failed)
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on", timeout_graceful_shutdown=3)
    urls = ", ".join(f"http://{f'[{b}]' if ':' in b else b}:{port}" for b in binds)
    if est is not None and args.verbose:
        print(est.line(), file=sys.stderr)
    server = _announcing_server(uvicorn)(config, f"gemmaspec serve: listening on {urls} (loading the model; /health "
                                                 "answers 503 until it is ready)")
    try:
        server.run(sockets=socks)
    finally:
        for sock in socks:
            sock.close()
    if failure:
        exc = failure[0]
        from ..errors import GemmaspecError

        if isinstance(exc, GemmaspecError):
            raise exc
        raise GemmaspecError(f"the model failed to load: {type(exc).__name__}: {exc}")
    return 0
