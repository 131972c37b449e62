"""The job runner: a request's generations go to the scheduler as :class:`~gemmaspec.server.scheduler.Job`
objects (:func:`submit`, the one place the server builds them), and their events come back through an
asyncio queue as one whole response (:func:`generate`) or a stream of server-sent events.

The scheduler thread hands each job's events to ``emit``, which puts them on the request's queue:
``("progress", {...})``, ``("events", [Event, ...])``, then ``("done", job)`` or ``("error", (status,
message))``. A request that runs several jobs (``n`` choices, several prompts) tags them with the
choice's index. Whatever ends a request (its last event, a client that went away) cancels its jobs,
which frees their slots.
"""

from __future__ import annotations

import asyncio
import itertools
import uuid
from dataclasses import replace

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from ..errors import GemmaspecError
from ..request import RequestOptions
from ..sampling import SamplingParams
from ..streaming import stop_matcher
from .apierror import APIError
from .responses import Formatter, NativeFormatter, sse, sse_error, usage_dict
from .scheduler import Job
from .state import ServerState
from .translate import check_context, spec_choose, spec_overrides

_groups = itertools.count(1)  # numbers of requests that run several jobs (Job.group)


def new_group() -> int:
    """A fresh number for a request that runs several jobs (``Job.group``)."""
    return next(_groups)


class JobStream(StreamingResponse):
    """Server-sent events for one job; whatever ends the response (the last event, a client that
    went away, a cancelled task) calls ``on_close``, which releases the job's slot."""

    def __init__(self, content, on_close):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send):
        async def watch():  # a client gone before the first event (e.g. during prefill) is noticed too
            while (await receive())["type"] != "http.disconnect":
                pass
            self._on_close()

        watcher = asyncio.create_task(watch())
        try:
            await super().__call__(scope, receive, send)
        finally:
            watcher.cancel()
            self._on_close()


async def submit(st: ServerState, req, kind: str, ids: list[int], params: SamplingParams, logprobs, fmt,
                 queue: asyncio.Queue, want_slot: int = -1, grammar=None, tag=None, group=None, images=()) -> Job:
    """Queue one generation of ``ids`` for request ``req`` at endpoint ``kind`` (``completions``,
    ``chat`` or ``completion``); its events arrive on ``queue`` (as ``(tag, item)`` when ``tag`` is
    given). The stop-string automaton and the grammar's constraint are built here, off the event
    loop's thread and off the scheduler's.

    Raises:
        APIError: 400 for a prompt longer than the context, bad ``speculative.*`` fields or a grammar
            that cannot run; 503 when the scheduler is not running.
    """
    e = st.engine
    # any model name is accepted while one model is served (llama-server does the same)
    check_context(ids, e.ctx_size, st.cfg.context_shift)
    n_max, n_min, p_min = spec_overrides(req, st.cfg)
    if params.stop:  # build the stop-string automaton here, not on the scheduler thread
        await asyncio.to_thread(stop_matcher, tuple(params.stop))
    constraint = None
    if grammar is not None:  # here too (the first one builds llguidance's tokenizer, seconds)
        try:
            constraint = await asyncio.to_thread(grammar.constraint, e.tokenizer)
        except GemmaspecError as exc:
            raise APIError(400, str(exc)) from None
    loop = asyncio.get_running_loop()

    def emit(item):
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item if tag is None else (tag, item))
        except RuntimeError:  # the event loop is gone (shutdown)
            pass

    name = getattr(fmt, "id", None) or f"cmpl-{uuid.uuid4().hex[:24]}"
    options = RequestOptions(params, n_max=n_max, n_min=n_min, p_min=p_min, choose_n=spec_choose(req, st.cfg),
                             logprobs=logprobs, constraint=constraint,
                             post_sampling=bool(getattr(req, "post_sampling_probs", False)),
                             context_shift=st.cfg.context_shift,
                             n_keep=st.cfg.n_keep if req.n_keep is None else req.n_keep, n_discard=req.n_discard)
    job = Job(ids, options, emit, name=name, endpoint=kind, want_slot=want_slot, cache_prompt=req.cache_prompt,
              progress=req.return_progress and req.stream, group=group, images=list(images))
    try:
        st.scheduler.submit(job)
    except RuntimeError as exc:
        raise APIError(503, str(exc)) from None
    return job


async def generate(st: ServerState, request: Request, req, kind: str, ids: list[int], params: SamplingParams,
                   logprobs, fmt, want_slot: int = -1, grammar=None, group=None, images=()):
    """One generation: a stream (``req.stream``) or the whole response (``fmt.final`` for
    ``/completion``, ``fmt.whole`` otherwise); a 499 response when the client leaves first.

    Raises:
        APIError: as :func:`submit`, or the scheduler's error for the job.
    """
    queue: asyncio.Queue = asyncio.Queue()
    job = await submit(st, req, kind, ids, params, logprobs, fmt, queue, want_slot, grammar, group=group, images=images)
    if req.stream:
        gen = native_stream(queue, fmt, job) if kind == "completion" else stream(queue, fmt, job)
        return JobStream(gen, on_close=lambda: st.scheduler.cancel(job))

    async def watch():  # the client's disconnect, noticed at once (not when tokens stop flowing)
        while (await request.receive())["type"] != "http.disconnect":
            pass
        st.scheduler.cancel(job)
        queue.put_nowait(("gone", None))

    watcher = asyncio.create_task(watch())
    events = []
    try:
        while True:
            what, payload = await queue.get()
            if what == "events":
                events.extend(payload)
            elif what == "progress":
                pass
            elif what == "done":
                return fmt.final(events, job) if kind == "completion" else fmt.whole(events, job)
            elif what == "gone":
                return Response(status_code=499)
            else:
                raise APIError(*payload)
    finally:
        watcher.cancel()
        st.scheduler.cancel(job)  # a no-op once the job is done


async def _submit_all(st: ServerState, req, kind: str, prompts: list[list[int]], each: list[SamplingParams],
                      logprobs, fmts: list, queue: asyncio.Queue, grammar, group: int, images=None) -> list[Job]:
    """Submit job i (``prompts[i]``, ``each[i]``, ``fmts[i]``, ``images[i]`` when given) tagged ``i`` on
    one queue; all or none (a failure cancels the ones already queued)."""
    jobs: list[Job] = []
    try:
        for i, fmt in enumerate(fmts):
            jobs.append(await submit(st, req, kind, prompts[i], each[i], logprobs, fmt, queue, req.id_slot,
                                     grammar=grammar, tag=i, group=group, images=images[i] if images else ()))
    except BaseException:
        for j in jobs:
            st.scheduler.cancel(j)
        raise
    return jobs


async def _gather(st: ServerState, request: Request, req, kind: str, prompts, each, logprobs, fmts, grammar,
                  group: int, images=None):
    """Run the jobs as :func:`generate` does, in parallel; their results in order, or the first
    error raised, or the 499 response when the client left."""
    got = await asyncio.gather(*[generate(st, request, req, kind, prompts[i], each[i], logprobs, fmt,
                                          want_slot=req.id_slot, grammar=grammar, group=group,
                                          images=images[i] if images else ())
                                 for i, fmt in enumerate(fmts)],
                               return_exceptions=True)
    for r in got:
        if isinstance(r, BaseException):
            raise r
        if isinstance(r, Response):  # the client left
            return r
    return got


async def generate_n(st: ServerState, request: Request, req, kind: str, prompts: list[list[int]],
                     params: SamplingParams, logprobs, fmts: list[Formatter], grammar, images=None):
    """Several choices (``n`` > 1, or several prompts on ``/v1/completions``): one job each, choice i
    running ``prompts[i]`` (the same list object for the choices of one prompt), in parallel as
    slots allow (``images[i]``: choice i's image spans, when given); a given seed S gives choice i the seed
    S + i, so choices differ and repeat. Merged
    into one response or one stream whose chunks carry their choice's ``index``; usage counts each
    prompt once and every choice's tokens.

    Raises:
        APIError: as :func:`generate`.
    """
    each = [params if params.seed < 0 else replace(params, seed=params.seed + i) for i in range(len(fmts))]
    group = new_group()
    if req.stream:
        queue: asyncio.Queue = asyncio.Queue()
        jobs = await _submit_all(st, req, kind, prompts, each, logprobs, fmts, queue, grammar, group, images)
        return JobStream(multi_stream(queue, fmts, jobs), on_close=lambda: [st.scheduler.cancel(j) for j in jobs])
    got = await _gather(st, request, req, kind, prompts, each, logprobs, fmts, grammar, group, images)
    if isinstance(got, Response):
        return got
    out = got[0]
    out["choices"] = [r["choices"][0] for r in got]
    first: dict[int, dict] = {}  # each prompt counted once, by its first choice (as usage_of)
    for p, r in zip(prompts, got):
        first.setdefault(id(p), r["usage"])
    out["usage"] = usage_dict(sum(u["prompt_tokens"] for u in first.values()),
                              sum(r["usage"]["completion_tokens"] for r in got),
                              sum(u["prompt_tokens_details"]["cached_tokens"] for u in first.values()))
    return out


async def generate_prompts(st: ServerState, request: Request, req, prompts: list[list[int]], params: SamplingParams,
                           n_probs, fmts: list[NativeFormatter], grammar, images=None):
    """Several ``/completion`` prompts: one job each, in parallel as slots allow (every prompt's
    length checked before any runs); an array of results in order, or one stream whose events carry
    their prompt's ``index`` (llama-server's).

    Raises:
        APIError: as :func:`generate`.
    """
    for ids in prompts:  # all or none: check every prompt before any runs
        check_context(ids, st.engine.ctx_size, st.cfg.context_shift)
    group = new_group()
    each = [params] * len(prompts)
    if req.stream:  # one stream, each event tagged with its prompt's index (llama-server's)
        queue: asyncio.Queue = asyncio.Queue()
        jobs = await _submit_all(st, req, "completion", prompts, each, n_probs, fmts, queue, grammar, group, images)
        return JobStream(native_multi_stream(queue, fmts, jobs),
                         on_close=lambda: [st.scheduler.cancel(j) for j in jobs])
    got = await _gather(st, request, req, "completion", prompts, each, n_probs, fmts, grammar, group, images)
    if isinstance(got, Response):
        return got
    return [{**r, "index": i} for i, r in enumerate(got)]


# -- streams -----------------------------------------------------------------------------------------
async def multi_stream(queue, fmts: list[Formatter], jobs: list[Job]):
    """Server-sent events of several OpenAI choices, each chunk carrying its choice's index."""
    if fmts[0].kind == "chat":
        for f in fmts:
            yield sse(f.first_chunk())
    left = len(jobs)
    while left:
        i, (what, payload) = await queue.get()
        if what == "progress":
            yield sse(fmts[i].progress_chunk(payload))
        elif what == "events":
            for ev in payload:
                yield sse(fmts[i].event_chunk(ev, jobs[i]))
        elif what == "done":
            left -= 1
            for c in fmts[i].final_chunks(jobs[i], usage_jobs=jobs if not left else []):
                yield sse(c)
        else:
            yield sse_error(payload)
            return
    yield "data: [DONE]\n\n"


async def stream(queue, fmt: Formatter, job: Job):
    """Server-sent events of one OpenAI choice. With tools, the reply's text is held back while it
    may still be a tool call (it starts with ``{``), and sent as ``tool_calls`` if it is one."""
    if fmt.kind == "chat":
        yield sse(fmt.first_chunk())
    held = [] if fmt.tools is not None else None  # events held back while the reply may be a tool call
    while True:
        what, payload = await queue.get()
        if what == "progress":
            yield sse(fmt.progress_chunk(payload))
        elif what == "events":
            for ev in payload:
                if held is not None:
                    held.append(ev)
                    start = "".join(e.text for e in held).lstrip()
                    if not start or start.startswith("{"):
                        continue
                    for e in held:  # plain text: stream it from here on
                        yield sse(fmt.event_chunk(e, job))
                    held = None
                    continue
                yield sse(fmt.event_chunk(ev, job))
        elif what == "done":
            finish = None
            if held is not None:
                calls = fmt.tool_calls("".join(e.text for e in held), job)
                if calls:
                    for c in fmt.tool_call_chunks(calls):
                        yield sse(c)
                    finish = "tool_calls"
                else:
                    for e in held:
                        yield sse(fmt.event_chunk(e, job))
            for c in fmt.final_chunks(job, finish):
                yield sse(c)
            yield "data: [DONE]\n\n"
            return
        else:
            yield sse_error(payload)
            return


async def native_multi_stream(queue, fmts: list[NativeFormatter], jobs: list[Job]):
    """Server-sent events of several ``/completion`` prompts, each event carrying its prompt's index."""
    left = len(jobs)
    while left:
        i, (what, payload) = await queue.get()
        if what == "progress":
            yield sse({**fmts[i].progress_chunk(payload, jobs[i]), "index": i})
        elif what == "events":
            for ev in payload:
                yield sse({**fmts[i].event_chunk(ev, jobs[i]), "index": i})
        elif what == "done":
            yield sse({**fmts[i].final([], jobs[i], content="", tokens=[]), "index": i})
            left -= 1
        else:
            yield sse_error(payload)
            return


async def native_stream(queue, fmt: NativeFormatter, job: Job):
    """Server-sent events of one ``/completion`` prompt (llama-server's: no ``[DONE]``)."""
    while True:
        what, payload = await queue.get()
        if what == "progress":
            yield sse(fmt.progress_chunk(payload, job))
        elif what == "events":
            for ev in payload:
                yield sse(fmt.event_chunk(ev, job))
        elif what == "done":
            yield sse(fmt.final([], job, content="", tokens=[]))
            return
        else:
            yield sse_error(payload)
            return
