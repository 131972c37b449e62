"""What ``gemmaspec bench`` measures: gemmaspec in this process, any OpenAI-compatible server by URL,
or llama.cpp through llama-cpp-python.

Every target answers :meth:`request` (one generation, blocking, callable from several threads at
once) with the same record, so one measuring loop (:mod:`.run`) serves all of them:

- ``tokens``: generated token ids (in-process and llama-cpp-python) or None; ``text``: the output;
- ``completion_tokens``; ``ttft_s`` (request sent → first token); ``decode_s`` (first → last token);
- ``arrivals``: seconds after sending at which tokens arrived, with how many (``[[t, n], ...]``);
- ``spec``: acceptance counters for this request (``draft_n``, ``draft_n_accepted`` and, in-process,
  ``verify_steps``, ``drafted_per_pos``, ``accepted_per_pos``), or None when the target reports none.

In-process concurrency goes through the server's own :class:`~gemmaspec.server.scheduler.Scheduler`
(continuous batching over slots, exactly what ``gemmaspec serve`` runs), without HTTP, so the figures
are the engine's and per-request acceptance and token ids come straight from ``RequestStats``.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

from ..errors import GemmaspecError, InputError
from .suite import Prompt


class BenchTargetError(GemmaspecError):
    """A target failed to answer (unreachable server, HTTP error, a request that failed)."""


def file_sha256(path) -> str | None:
    """sha256 (hex) of a file; for the default model, read from its check stamp when it is current
    (``<model>.verified.json``, written by :mod:`gemmaspec.manage.default_model`). None for a
    directory or a missing path."""
    p = Path(path)
    if not p.is_file():
        return None
    stamp = p.with_suffix(".verified.json")
    try:
        rec = json.loads(stamp.read_text())
        st = p.stat()
        if rec.get("size") == st.st_size and rec.get("mtime_ns") == st.st_mtime_ns and rec.get("sha256"):
            return rec["sha256"]
    except (OSError, ValueError):
        pass
    h = hashlib.sha256()
    with open(p, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


def spec_label(spec_type: str, n_max) -> str:
    """``none`` for no speculation (n_max 0), else ``SPEC n=N`` (``n=chooseN``: each round's length
    chosen per slot from measured costs, up to N; the server's default)."""
    return "none" if n_max == 0 else f"{spec_type} n={n_max}"


def choose_bound(n_max) -> int | None:
    """N of a ``chooseN`` draft length (chosen per round, up to N), else None (a fixed length or auto)."""
    m = re.fullmatch(r"choose(\d+)", str(n_max))
    return int(m.group(1)) if m else None


PLAN_COUNTERS = {"rounds": "gemmaspec_spec_planned_rounds_total",
                 "predicted_tokens": "gemmaspec_spec_predicted_tokens_total",
                 "predicted_seconds": "gemmaspec_spec_predicted_seconds_total",
                 "tokens": "gemmaspec_spec_round_tokens_total", "seconds": "gemmaspec_spec_round_seconds_total"}
"""``gemmaspec serve``'s counters of rounds whose draft lengths were chosen, by :class:`~gemmaspec.speculative.planner.PlanTotals` field."""


# -- gemmaspec in this process ---------------------------------------------------------------------
class InProcessTarget:
    """gemmaspec's engine in this process; one scheduler per speculative type (each with ``n_slots``
    slots), the no-speculation runs on the first one with draft length 0.

    Args:
        model: GGUF / checkpoint path (None: the default model).
        drafts: ``-md`` paths (draft models and/or MTP assistants); each serves the type its role
            gives (an assistant ``draft-mtp``, a model ``draft-simple``).
        spec_types: speculative types to measure (``--spec-type``), e.g. ``["ngram-simple"]``; empty:
            the types of ``drafts``.
        n_slots: concurrent requests (the largest user count).
        ctx_size: context per slot, tokens.
        threads, device: as for ``gemmaspec generate``.
        p_min: ``--spec-draft-p-min`` of the model drafters (None: each drafter's own, see
            :func:`gemmaspec.speculative.plan.plan`); ``describe()["p_min"]`` gives the value per type.

    Raises:
        GemmaspecError: the model or a drafter cannot be loaded; a draft type without its ``-md``.
    """

    name = "gemmaspec"

    def __init__(self, model, drafts, spec_types: list[str], n_slots: int, ctx_size: int, threads=None,
                 device="cpu", p_min: float | None = None):
        from ..loading.engine import load_engine
        from ..manage.default_model import default_model_path
        from ..speculative.options import spec_model_type

        self.model_path = Path(model) if model else default_model_path()
        self.draft_paths = [Path(d) for d in drafts or []]
        self.engine = load_engine(self.model_path, ctx_size=ctx_size, device=device, threads=threads)
        by_type = {}
        for d in self.draft_paths:
            pl, make = self._factory(None, str(d), p_min)
            if pl.spec_type in by_type:
                raise InputError(f"two -md files for {pl.spec_type}: give one draft model and/or one assistant")
            by_type[pl.spec_type] = (make, d)
        self.schedulers = {}
        self.spec_types = []
        self.drafts = {}
        self.p_min = {}
        for st in spec_types or list(by_type):
            if st in ("draft-simple", "draft-mtp"):
                if st == "draft-mtp" and st not in by_type:  # the assistant gemmaspec ships for this target
                    try:
                        pl, make = self._factory(st, None, p_min)
                    except InputError:
                        pass  # none shipped: said below
                    else:
                        by_type[st] = (make, Path(pl.draft_file))
                        self.draft_paths.append(Path(pl.draft_file))
                if st not in by_type:
                    what = "an MTP assistant" if st == "draft-mtp" else "a draft model"
                    have = f" (-md gave {', '.join(by_type)})" if by_type else ""
                    raise InputError(f"--spec-type {st} needs {what} as -md{have}")
                (make, d), real = by_type[st], st
                self.drafts[real] = str(d)
            else:  # a draftless type, "default", or a list ("ngram-simple,draft-mtp") with its model type's -md
                mt = spec_model_type(st)
                md = str(by_type[mt][1]) if mt in by_type else None
                pl, make = self._factory(st, md, p_min)
                real = pl.spec_type
                if pl.draft_file:  # a list's model file, -md or shipped
                    self.drafts.setdefault(pl.model_type, pl.draft_file)
            if real not in self.schedulers:
                if spec_model_type(real):  # the p-min its model drafter runs with (--spec-draft-p-min or its own)
                    self.p_min[real] = make.p_min
                self.spec_types.append(real)
                self.schedulers[real] = self._start(make, n_slots)
        if self.spec_types:  # the cost model's calibration now, as `gemmaspec serve` does at load, not
            # inside the first phase that chooses draft lengths (its wall time would include it)
            from ..speculative.options import MAX_DRAFT_TOKENS

            self.engine.forward_costs(MAX_DRAFT_TOKENS)

    def _factory(self, spec_type, draft, p_min):
        """``(plan, factory)`` of :mod:`gemmaspec.speculative.plan` for one type of this target."""
        from ..speculative.config import SpecConfig
        from ..speculative.plan import build, plan

        pl = plan(SpecConfig(spec_type, draft, p_min=p_min), self.model_path)
        return pl, build(pl, self.engine, warn=lambda line: print(line, file=sys.stderr))

    def _start(self, make, n_slots):
        from ..server.scheduler import Scheduler

        errors = []
        sched = Scheduler(lambda: (self.engine, make), n_slots, on_load_error=errors.append)
        sched.start()
        while not sched.ready.is_set() and not errors:
            time.sleep(0.01)
        if errors:
            raise errors[0]
        return sched

    def encode(self, p: Prompt) -> list[int]:
        tok = self.engine.tokenizer
        return tok.encode_chat(p.message_dicts()) if p.messages else self.engine.encode_prompt(p.prompt)

    def prompt_tokens(self, p: Prompt) -> int:
        return len(self.encode(p))

    def request(self, p: Prompt, spec_type: str, n_max, max_tokens: int, temp: float, seed: int,
                stop: threading.Event | None = None) -> dict:
        from ..request import RequestOptions
        from ..sampling import SamplingParams
        from ..server.scheduler import Job

        sched = self.schedulers[spec_type] if n_max != 0 else next(iter(self.schedulers.values()))
        ids = self.encode(p)
        params = SamplingParams(temperature=temp, max_tokens=max_tokens, ignore_eos=True, seed=seed).validate()
        inbox: queue.Queue = queue.Queue()
        t0 = time.perf_counter()

        def emit(item):
            inbox.put((time.perf_counter(), item))

        bound = choose_bound(n_max)
        opts = RequestOptions(params, n_max=n_max if bound is None else bound, choose_n=bound is not None)
        job = Job(ids, opts, emit, name="bench", quiet=True)  # its figures go to results.json, not to stderr
        sched.submit(job)
        arrivals, tokens, text = [], [], []
        while True:
            try:
                t, (what, payload) = inbox.get(timeout=0.2)
            except queue.Empty:
                if stop is not None and stop.is_set():
                    sched.cancel(job)
                    raise KeyboardInterrupt
                continue
            if what == "events":
                n = sum(len(e.tokens) for e in payload)
                if n:
                    arrivals.append([t - t0, n])
                tokens.extend(tok for e in payload for tok in e.tokens)
                text.extend(e.text for e in payload)
            elif what == "done":
                break
            else:
                raise BenchTargetError(f"gemmaspec failed a request ({payload[0]}): {payload[1]}")
        st = job.stats
        return _record(arrivals, tokens, "".join(text), st.generated_tokens, st.spec.to_dict() | {"source": "engine"},
                       prompt_tokens=len(ids))

    def top2_margin(self, p: Prompt, prefix: list[int]) -> float:
        """Target logit of the most likely token minus the second, after the prompt + ``prefix``
        (greedy decoding picks the first; a margin near 0 is a near-tie). Runs on a scratch cache;
        call only while no request is running."""
        import torch

        ids = self.encode(p) + list(prefix)
        cache = self.engine.model.new_cache(self.engine.ctx_size, self.engine.max_rollback)
        out = self.engine._prefill(ids, cache)
        top = torch.topk(out.logits[-1].float(), 2).values
        return float(top[0] - top[1])

    def counters(self):
        return None

    def plan_totals(self) -> dict:
        """The schedulers' totals of rounds whose draft lengths were chosen (summed; a phase uses one)."""
        out = {k: 0 for k in PLAN_COUNTERS}
        out["chosen_n"] = {}
        for sched in self.schedulers.values():
            t = sched.planner.totals.as_dict() if sched.planner is not None else {}
            for k in PLAN_COUNTERS:
                out[k] += t.get(k, 0)
            for n, c in t.get("chosen_n", {}).items():
                out["chosen_n"][n] = out["chosen_n"].get(n, 0) + c
        return out

    def describe(self) -> dict:
        e = self.engine
        return {"kind": "in-process", "name": "gemmaspec", "model": str(self.model_path),
                "model_sha256": file_sha256(self.model_path),
                "drafts": {t: {"path": d, "sha256": file_sha256(d)} for t, d in self.drafts.items()},
                "p_min": dict(self.p_min),
                "spec_types": self.spec_types, "ctx_size": e.ctx_size, "device": str(e.model.device),
                "threads": _torch_threads(),
                "batched": all(s.batched for s in self.schedulers.values())}

    def memory(self) -> dict:
        """Peak resident memory of this process (MiB) and, on CUDA, peak GPU memory allocated (MiB)."""
        import resource

        out = {"peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
        if self.engine.model.device.type == "cuda":
            import torch

            out["gpu_peak_mib"] = torch.cuda.max_memory_allocated() / 2**20
        return out

    def close(self):
        for s in self.schedulers.values():
            s.close()


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def _record(arrivals, tokens, text, n_tokens, spec, prompt_tokens=None) -> dict:
    ttft = arrivals[0][0] if arrivals else None
    return {"tokens": tokens, "text": text, "completion_tokens": n_tokens, "prompt_tokens": prompt_tokens,
            "ttft_s": ttft, "decode_s": (arrivals[-1][0] - arrivals[0][0]) if arrivals else 0.0,
            "arrivals": [[round(t, 6), n] for t, n in arrivals], "spec": spec}


# -- any OpenAI-compatible server ---------------------------------------------------------------------
_METRIC_LINE = re.compile(r'^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eE]+|NaN|[+-]?Inf)\s*$')
# (drafted, accepted, verify steps, per-position prefix) counter names, llama.cpp's and vLLM's (ours: vLLM's)
_DRAFTED = ("spec_decode_num_draft_tokens_total", "llamacpp:n_drafted_total")
_ACCEPTED = ("spec_decode_num_accepted_tokens_total", "llamacpp:n_drafted_accepted_total", "llamacpp:n_accepted_total")
_STEPS = ("spec_decode_num_drafts_total",)
_PER_POS = "spec_decode_num_accepted_tokens_per_pos_total"


def parse_metrics(text: str) -> dict:
    """The speculative counters in a Prometheus exposition: ``{"draft_n", "draft_n_accepted",
    "verify_steps", "accepted_per_pos"}`` (a key absent when the server does not export it). Names
    are vLLM's (``vllm:spec_decode_num_draft_tokens_total``, ``..._accepted_tokens_total``,
    ``..._drafts_total``, ``..._accepted_tokens_per_pos_total{position=...}``, with or without the
    ``vllm:`` prefix, as gemmaspec serves them) or llama.cpp's (``llamacpp:n_drafted_total``,
    ``llamacpp:n_drafted_accepted_total`` / ``llamacpp:n_accepted_total``)."""
    vals: dict[str, float] = {}
    per_pos: dict[int, float] = {}
    for line in text.splitlines():
        m = _METRIC_LINE.match(line.strip())
        if not m:
            continue
        name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
        base = name.split(":", 1)[1] if name.startswith("vllm:") else name
        if base == _PER_POS:
            pm = re.search(r'position="(\d+)"', labels)
            if pm:
                per_pos[int(pm.group(1))] = per_pos.get(int(pm.group(1)), 0.0) + value
            continue
        vals[base] = vals.get(base, 0.0) + value
    out = {}
    for key, names in (("draft_n", _DRAFTED), ("draft_n_accepted", _ACCEPTED), ("verify_steps", _STEPS)):
        for n in names:
            if n in vals:
                out[key] = vals[n]
                break
    if per_pos:
        out["accepted_per_pos"] = [per_pos.get(i, 0.0) for i in range(max(per_pos) + 1)]
    return out


class UrlTarget:
    """An OpenAI-compatible server (gemmaspec serve, llama-server, vLLM, SGLang). Prompts go to
    ``/v1/completions``, conversations to ``/v1/chat/completions``, streamed, with llama-server's
    per-request ``speculative.n_max`` (servers that ignore it speculate as they were started).
    Acceptance: the final chunk's ``timings`` (``draft_n``, ``draft_n_accepted``; llama-server and
    gemmaspec), else ``/metrics`` counter deltas around each phase (:func:`parse_metrics`).

    Raises:
        BenchTargetError: the server cannot be reached or refuses the key.
    """

    def __init__(self, url: str, api_key: str | None = None, model: str | None = None, name: str = "server",
                 timeout: float = 600.0):
        import httpx

        if not re.match(r"^https?://", url):
            raise InputError(f"--url must start with http:// or https:// (got {url})")
        self.url = url.rstrip("/").removesuffix("/v1")
        self.name = name
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(timeout=timeout, headers=self.headers)
        self.model = model
        self.server_info: dict = {}
        try:
            r = self.client.get(self.url + "/v1/models", timeout=10)
        except httpx.HTTPError as exc:
            raise BenchTargetError(f"cannot reach {self.url}: {exc.__class__.__name__}: {exc}; is the server "
                                   "running, and is the address right?") from None
        if r.status_code == 401:
            raise BenchTargetError(f"{self.url} refused the request (401): pass its key with --api-key")
        if r.status_code == 200:
            try:
                data = r.json().get("data") or []
                if data and self.model is None:
                    self.model = data[0].get("id")
                self.server_info["models"] = [d.get("id") for d in data]
            except ValueError:
                pass
        try:
            props = self.client.get(self.url + "/props", timeout=10)
            if props.status_code == 200:
                pj = props.json()
                self.server_info["props"] = {k: pj.get(k) for k in ("model", "model_path", "total_slots",
                                                                        "speculative", "build_info") if k in pj}
        except (httpx.HTTPError, ValueError):
            pass
        self.has_metrics = self.counters() is not None

    def counters(self) -> dict | None:
        """The server's speculative counters now (:func:`parse_metrics`), or None without ``/metrics``
        or without any speculative counter in it."""
        import httpx

        try:
            r = self.client.get(self.url + "/metrics", timeout=10)
        except httpx.HTTPError:
            return None
        if r.status_code != 200:
            return None
        c = parse_metrics(r.text)
        return c if "draft_n" in c else None

    def plan_totals(self) -> dict | None:
        """``gemmaspec serve``'s totals of rounds whose draft lengths were chosen (:data:`PLAN_COUNTERS`
        from ``/metrics``), or None from a server without them."""
        import httpx

        try:
            r = self.client.get(self.url + "/metrics", timeout=10)
        except httpx.HTTPError:
            return None
        vals = {}
        for line in r.text.splitlines() if r.status_code == 200 else []:
            m = _METRIC_LINE.match(line.strip())
            if m and not m.group(2):
                vals[m.group(1)] = float(m.group(3))
        if PLAN_COUNTERS["rounds"] not in vals:
            return None
        return {k: vals.get(name, 0.0) for k, name in PLAN_COUNTERS.items()}

    def request(self, p: Prompt, spec_type: str, n_max, max_tokens: int, temp: float, seed: int,
                stop: threading.Event | None = None) -> dict:
        import httpx

        bound = choose_bound(n_max)  # gemmaspec's speculative.n_fixed: other servers ignore it
        body = {"max_tokens": max_tokens, "temperature": temp, "seed": seed, "stream": True, "ignore_eos": True,
                "stream_options": {"include_usage": True}, "speculative.n_max": n_max if bound is None else bound,
                "speculative.n_fixed": bound is None}
        if self.model:
            body["model"] = self.model
        if p.messages:
            path, body["messages"] = "/v1/chat/completions", p.message_dicts()
        else:
            path, body["prompt"] = "/v1/completions", p.prompt
        t0 = time.perf_counter()
        arrivals, text, usage, timings = [], [], None, None
        try:
            with self.client.stream("POST", self.url + path, json=body) as r:
                if r.status_code != 200:
                    r.read()
                    raise BenchTargetError(f"{self.url}{path} answered {r.status_code}: {r.text[:300]}")
                for line in r.iter_lines():
                    if stop is not None and stop.is_set():
                        raise KeyboardInterrupt
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    now = time.perf_counter() - t0
                    if "error" in chunk:
                        raise BenchTargetError(f"{self.url}{path}: {chunk['error']}")
                    usage = chunk.get("usage") or usage
                    timings = chunk.get("timings") or timings
                    for ch in chunk.get("choices") or []:
                        piece = ch.get("text") if "text" in ch else (ch.get("delta") or {}).get("content")
                        if piece is None:
                            continue
                        if piece or not (ch.get("finish_reason")):
                            arrivals.append([now, 1])
                            text.append(piece)
        except httpx.HTTPError as exc:
            raise BenchTargetError(f"request to {self.url}{path} failed: {exc.__class__.__name__}: {exc}") from None
        n = (usage or {}).get("completion_tokens") or sum(a[1] for a in arrivals)
        spec = None
        if timings and "draft_n" in timings:
            spec = {"draft_n": timings["draft_n"], "draft_n_accepted": timings.get("draft_n_accepted", 0),
                    "source": "timings"}
        return _record(arrivals, None, "".join(text), n, spec, prompt_tokens=(usage or {}).get("prompt_tokens"))

    def describe(self) -> dict:
        return {"kind": "url", "name": self.name, "url": self.url, "model": self.model,
                "metrics": self.has_metrics, **self.server_info}

    def close(self):
        self.client.close()


# -- llama.cpp through llama-cpp-python ----------------------------------------------------------------
LLAMA_WORKER = r'''
import json, sys, time
from llama_cpp import Llama
a = json.loads(sys.argv[1])
llms = {}
def get(spec):  # llama-cpp-python's draft path needs logits for every position: a second instance (weights mmapped, shared)
    if spec not in llms:
        llms[spec] = Llama(model_path=a["model"], n_threads=a["threads"], n_threads_batch=a["threads"], n_ctx=a["ctx"],
                           verbose=False, seed=0, logits_all=spec)
    return llms[spec]
get(False)
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    r = json.loads(line)
    llm = get(bool(r["n_max"]))
    llm.reset()  # no prompt-prefix reuse between requests (gemmaspec prefills every request too)
    if r["n_max"]:
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
        llm.draft_model = LlamaPromptLookupDecoding(num_pred_tokens=r["n_max"])
    eos = [llm.token_eos()] + [t for t in llm.tokenize(b"<end_of_turn>", add_bos=False, special=True)][:1]
    if r.get("ids"):
        ids = r["ids"]
    elif r.get("messages"):
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter
        fmt = Jinja2ChatFormatter(template=llm.metadata.get("tokenizer.chat_template", ""), eos_token="<eos>",
                                  bos_token="<bos>")
        ids = llm.tokenize(fmt(messages=r["messages"]).prompt.encode(), add_bos=False, special=True)
    else:
        ids = llm.tokenize(r["prompt"].encode(), add_bos=True, special=True)
    bias = {t: -1e9 for t in eos}
    t0 = time.perf_counter(); arrivals = []; out = []
    for c in llm.create_completion(ids, max_tokens=r["max_tokens"], temperature=r["temp"],
                                   top_k=1 if r["temp"] == 0 else 40, seed=r["seed"], stream=True, logit_bias=bias):
        ch = c["choices"][0]
        if ch.get("finish_reason") is None or ch["text"]:
            arrivals.append([time.perf_counter() - t0, 1]); out.append(ch["text"])
    print(json.dumps({"arrivals": arrivals, "text": "".join(out), "prompt_tokens": len(ids)}), flush=True)
'''


class LlamaCppTarget:
    """llama.cpp on the same GGUF through llama-cpp-python, in a worker process of its own virtual
    environment (``benchmarks/common.py`` installs it; nothing is built here), given the prompt's token
ids as gemmaspec's tokenizer and chat template make them when ``encode`` is given. One sequence at a time
    (users > 1 are not run for it); speculation is its prompt-lookup decoding
    (``LlamaPromptLookupDecoding``, an n-gram drafter) with ``num_pred_tokens = n_max``.

    Raises:
        InputError: llama-cpp-python is not installed.
    """

    name = "llama.cpp"
    single_user = True
    # llama-cpp-python's only drafter is prompt lookup: the n-gram configurations run; draft-model and
    # MTP configurations have no counterpart there and are left out (not run under another name)
    can_speculate = ("ngram-simple",)

    def __init__(self, model, threads: int, ctx: int, python: str | None = None, encode=None):
        from ..paths import cache_home

        self.encode = encode  # Prompt -> token ids (ours), so both engines run the very same input
        py = Path(python) if python else cache_home() / "bench" / "llama-venv" / "bin" / "python"
        if not py.exists():
            raise InputError(f"--peer llama.cpp needs llama-cpp-python in {py.parent.parent} (install it with "
                             "benchmarks/common.py's llama_python()), or use --peer-url URL with a running llama-server")
        self.model = str(model)
        env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY",)}
        self.proc = subprocess.Popen([str(py), "-c", LLAMA_WORKER, json.dumps({"model": self.model, "threads": threads,
                                                                                "ctx": ctx})],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        line = self.proc.stdout.readline()
        if not line:
            raise BenchTargetError("llama-cpp-python's worker ended before it was ready (see its stderr above)")
        self.lock = threading.Lock()
        self.version = subprocess.run([str(py), "-c", "import llama_cpp; print(llama_cpp.__version__)"],
                                      capture_output=True, text=True).stdout.strip()

    def request(self, p: Prompt, spec_type: str, n_max, max_tokens: int, temp: float, seed: int,
                stop: threading.Event | None = None) -> dict:
        n = 0 if n_max == 0 else (3 if n_max == "auto" else choose_bound(n_max) or int(n_max))  # chooseN: N
        msg = {"prompt": p.prompt, "messages": p.message_dicts() if p.messages else None, "n_max": n,
               "ids": self.encode(p) if self.encode else None,
               "max_tokens": max_tokens, "temp": temp, "seed": seed}
        with self.lock:
            self.proc.stdin.write(json.dumps(msg) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        if not line:
            raise BenchTargetError("llama-cpp-python's worker ended during a request")
        r = json.loads(line)
        return _record(r["arrivals"], None, r["text"], sum(a[1] for a in r["arrivals"]), None, r["prompt_tokens"])

    def counters(self):
        return None

    def describe(self) -> dict:
        return {"kind": "llama-cpp-python", "name": self.name, "model": self.model, "version": self.version,
                "speculation": "llama-cpp-python's prompt-lookup decoding (Python; num_pred_tokens = n_max, auto = 3; "
                               "runs on a second instance with logits for every position)",
                "input": "gemmaspec's token ids" if self.encode else "llama.cpp's tokenizer"}

    def close(self):
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
