"""The scheduler: one background thread owns the model and serves every request.

Continuous batching over ``n_slots`` slots. Each slot has its own KV cache and its own drafter; a
request runs as a :class:`~gemmaspec.engine.RequestState` in a slot, so the server shares the
engine's round logic (draft → verify → stop checks → rollback) with ``gemmaspec generate``. The loop:

1. admit queued requests (FIFO; a request's further choices or prompts yield to other requests) into
   free slots and prefill them, one at a time;
2. plan every active slot's round (:class:`~gemmaspec.speculative.planner.RoundPlanner`): each slot's
   draft length chosen for the whole batch from measured costs (a request with ``choose_n`` off
   drafts its own fixed length), the MTP assistant drafting for all slots at once, then
   ``begin_round`` with the draft (the pending token + drafts);
3. run all of them in one target forward (``model.forward_batch``; a model without it runs the
   slots one forward at a time);
4. finish each slot's round (``finish_round``), hand its events to the request's listener, and free
   the slots whose requests finished or were cancelled.

Requests join and leave between rounds. Because a batched forward computes every sequence's rows
bit-identically to running it alone, each request's tokens at temperature 0 are exactly what it
would get alone. A cancelled request (its client went away) leaves at the next round boundary, or
during its prefill before the next chunk of the prompt.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable

from ..engine import Engine, Event, RequestState, RequestStats
from ..errors import GemmaspecError
from ..multimodal import keyed
from ..request import RequestOptions
from ..speculative.planner import RoundPlanner

log = logging.getLogger("gemmaspec.server")
_ids = itertools.count(1)


@dataclass
class Job:
    """One request as the scheduler sees it.

    Attributes:
        prompt_ids: prompt token ids (checked against the context by the caller).
        options: what the request asks for (sampling, drafting, log-probabilities, grammar, context
            shift): a :class:`~gemmaspec.request.RequestOptions`; its ``p_min`` is set on the slot's
            drafter for the request and the slot's own value restored when it ends.
        emit: called from the scheduler thread with ``("progress", {...})`` (only with
            ``progress``) and ``("events", [Event, ...])``, then exactly one of ``("done", job)`` or
            ``("error", (http_status, message))``; it must be thread-safe and
            must not block. A cancelled job gets nothing more.
        name: request id used in logs and ``/slots`` (``cmpl-...``).
        endpoint: ``completions``, ``chat`` or ``completion`` (llama-server's native; a metrics label).
        want_slot: run only in this slot (llama-server's ``id_slot``); -1 for any.
        group: the request's number when it runs several jobs (``n`` choices, several ``/completion``
            prompts): queued, they yield to other requests' jobs while some of them run.
        cache_prompt: reuse the KV of the longest prefix a free slot already holds (llama-server's
            ``cache_prompt``); the request goes to the free slot holding the longest one when it counts
            (:func:`pick_slot`), else (and without ``cache_prompt``) to the least recently used free
            slot, so another user's cached conversation is not evicted for a few shared template tokens.
        progress: emit ``("progress", {"total", "cache", "processed", "time_ms"})`` before and after
            each prefill chunk (llama-server's ``return_progress``).
        quiet: no log line when it ends (at DEBUG instead of INFO): ``gemmaspec bench``'s in-process
            requests, whose figures go to its results, not one line each on stderr.
        images: the prompt's images (:class:`~gemmaspec.multimodal.ImageSpan`); the slot's cache is
            matched by :meth:`~gemmaspec.engine.RequestState.cache_keys`, so KV is reused past an image
            only for the same image at the same place.
    After it ends, ``stop_word`` is the stop string that ended it ("" if none), ``cache_n`` the
    prompt tokens reused from the slot's cache (0: the whole prompt was prefilled) and ``n_cached``
    the tokens whose KV the slot keeps (llama-server's ``tokens_cached``: the prompt and the reply but
    its last token, which was never run).
    """

    prompt_ids: list[int]
    options: RequestOptions
    emit: Callable[[tuple], None]
    name: str = ""
    endpoint: str = "completions"
    want_slot: int = -1
    cache_prompt: bool = True
    progress: bool = False
    group: int | None = None  # the request it belongs to, when one request runs several jobs (n, prompts)
    images: list = field(default_factory=list)
    quiet: bool = False
    stop_word: str = ""
    cache_n: int = 0
    n_cached: int = 0
    id_task: int = -1  # a number, as llama-server's /slots shows it (given at submit)
    stats: RequestStats = field(default_factory=RequestStats)
    t_arrival: float = field(default_factory=time.perf_counter)
    t_first: float | None = None  # first token handed to emit (perf_counter seconds)
    t_done: float | None = None
    cancelled: bool = False
    slot: int | None = None
    state: RequestState | None = None

    @property
    def ttft_ms(self) -> float:
        """Arrival → first token, ms (includes queueing and prefill); 0 before the first token."""
        return (self.t_first - self.t_arrival) * 1e3 if self.t_first else 0.0


@dataclass
class Slot:
    index: int
    cache: object
    drafter: object
    job: Job | None = None
    served: int = 0  # requests completed in this slot
    last: Job | None = None  # the last request it finished (llama-server's task_prev)
    cached: list = field(default_factory=list)  # the ids whose KV the cache holds (positions 0..)
    last_used: float = 0.0  # when its last request ended (perf_counter; 0: never)
    p_min: float | None = None  # its drafter's own p_min (None: the drafter has none)

    def use_p_min(self, value: float | None) -> None:
        """Set the drafter's ``p_min`` for a request (None: the slot's own); a no-op for a drafter
        without one (n-gram lookup)."""
        if self.p_min is not None:
            self.drafter.p_min = self.p_min if value is None else value


SLOT_SIMILARITY = 0.1
"""Share of a prompt a free slot's kept tokens must cover for the request to go there (llama-server's
``--slot-prompt-similarity`` default)."""


def pick_slot(free: list["Slot"], prompt: list[int], cache_prompt: bool) -> "Slot":
    """The free slot a request runs in: the one whose kept tokens share the longest prefix with
    ``prompt``, if that prefix covers more than :data:`SLOT_SIMILARITY` of the prompt (llama-server's
    rule) and at least half of what the slot keeps (the request reuses as much as it throws away:
    another conversation that shares only the chat template's head is not evicted); else the least
    recently used free slot (one never used first)."""
    if cache_prompt and prompt:
        n, best = max(((common_prefix(f.cached, prompt), f) for f in free), key=lambda x: x[0])
        if n > SLOT_SIMILARITY * len(prompt) and 2 * n >= len(best.cached):
            return best
    return min(free, key=lambda f: f.last_used)


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two id lists."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class Scheduler:
    """Runs requests on one engine from a background thread, ``n_slots`` at a time.

    Args:
        load: called once on the scheduler's thread; returns ``(engine, make_drafter)`` where
            ``make_drafter(cache)`` gives a fresh drafter for a slot's cache (see
            :func:`gemmaspec.speculative.plan.build`). Loading on this thread keeps every model
            operation (and the torch thread setting) on one thread.
        n_slots: requests served concurrently (``-np``); more wait in a FIFO queue.
        metrics: a :class:`~gemmaspec.server.metrics.Metrics` or None.
        on_ready: called (on the scheduler thread) once loading has finished.
        on_load_error: called with the exception if loading fails; the thread then ends.

    Raises:
        ValueError: n_slots < 1.
    """

    def __init__(self, load: Callable[[], tuple[Engine, Callable]], n_slots: int, metrics=None,
                 on_ready: Callable[[], None] | None = None, on_load_error: Callable[[BaseException], None] | None = None):
        if n_slots < 1:
            raise ValueError(f"need at least one slot (got {n_slots})")
        self._load, self.n_slots, self.metrics = load, n_slots, metrics
        self._on_ready, self._on_load_error = on_ready, on_load_error
        self.engine: Engine | None = None
        self.slots: list[Slot] = []
        self.batched = False
        self.planner: RoundPlanner | None = None  # each round's drafting, built with the engine
        self.ready = threading.Event()
        self._queue: deque[Job] = deque()
        self._actions: deque[tuple[int, Callable, Future]] = deque()  # slot actions (save/restore/erase)
        self._cond = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._main, name="gemmaspec-scheduler", daemon=True)

    # -- called from other threads ----------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def close(self, timeout: float = 10.0) -> None:
        """Stop after the current round; queued and running requests get an error."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def submit(self, job: Job) -> None:
        """Queue a request (never dropped; served in arrival order as slots free up).

        Raises:
            RuntimeError: the scheduler is stopped or not loaded.
        """
        if not self.ready.is_set():
            raise RuntimeError("the model is not loaded yet")
        with self._cond:
            if self._stop:
                raise RuntimeError("the server is shutting down")
            job.id_task = next(_ids)
            job.name = job.name or f"req-{job.id_task}"
            self._queue.append(job)
            self._cond.notify_all()

    def cancel(self, job: Job) -> None:
        """The client went away: drop a queued request now, or free its slot before the next round."""
        with self._cond:
            if job.t_done is not None:
                return
            job.cancelled = True
            if job in self._queue:
                self._queue.remove(job)
                job.t_done = time.perf_counter()
                job.stats.stop_reason = "cancelled"
                log.info("%s: cancelled while queued", job.name)
            self._cond.notify_all()

    def slot_action(self, index: int, fn: Callable[[Slot], object]) -> Future:
        """Run ``fn(slot)`` on the scheduler thread once slot ``index`` is free (between rounds, before
        the next admission; llama-server defers slot actions the same way); the future gets its result
        or exception.

        Raises:
            RuntimeError: the scheduler is stopped or not loaded.
        """
        if not self.ready.is_set():
            raise RuntimeError("the model is not loaded yet")
        fut: Future = Future()
        with self._cond:
            if self._stop:
                raise RuntimeError("the server is shutting down")
            self._actions.append((index, fn, fut))
            self._cond.notify_all()
        return fut

    def _run_actions(self) -> None:
        with self._cond:
            ready = [a for a in self._actions if self.slots[a[0]].job is None]
            for a in ready:
                self._actions.remove(a)
        for index, fn, fut in ready:
            try:
                fut.set_result(fn(self.slots[index]))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                fut.set_exception(exc)

    def queued(self) -> int:
        with self._cond:
            return len(self._queue)

    def running(self) -> int:
        with self._cond:
            return sum(s.job is not None for s in self.slots)

    def slots_info(self, describe=None) -> list[dict]:
        """One dict per slot: whether it is busy and with what (``/slots``); ``describe(job, last)``
        adds fields for a slot that runs a request (``job``) or has run one (``last``, job None): the
        server's llama-server ``params`` and ``next_token``; a slot that never ran one has neither,
        as in llama-server."""
        out = []
        with self._cond:
            for s in self.slots:
                j = s.job
                st = j.stats if j else None
                out.append({
                    "id": s.index,
                    "is_processing": j is not None,
                    "request": j.name if j else None,
                    "n_ctx": self.engine.ctx_size,
                    "n_past": s.cache.length if j else len(s.cached),  # tokens whose KV it holds
                    "n_prompt_tokens": st.prompt_tokens if st else 0,
                    "n_prompt_tokens_cache": j.cache_n if j else 0,
                    "n_prompt_tokens_processed": st.prompt_tokens - j.cache_n if st else 0,
                    "n_decoded": st.generated_tokens if st else 0,
                    "draft_n": st.spec.drafted if st else 0,
                    "draft_n_accepted": st.spec.accepted if st else 0,
                    # the draft length chosen for the slot's last round (speculative/planner.py)
                    "draft_n_chosen": (self.planner.last.get(s.index) or {}).get("n"),
                    "draft_choice": self.planner.last.get(s.index),
                    "requests_served": s.served,
                    **(describe(j, s.last) if describe and (j or s.last) else {}),
                })
        return out

    # -- the scheduler thread -----------------------------------------------------------------------
    def _main(self) -> None:
        try:
            engine, make_drafter = self._load()
            self.engine = engine
            self.slots = []
            for i in range(self.n_slots):
                cache = engine.model.new_cache(engine.ctx_size, engine.max_rollback)
                drafter = make_drafter(cache)
                self.slots.append(Slot(i, cache, drafter, p_min=getattr(drafter, "p_min", None)))
            self.batched = hasattr(engine.model, "forward_batch")
            self.planner = RoundPlanner(engine)
        except BaseException as exc:  # noqa: BLE001 - reported to the server, which exits
            if self._on_load_error:
                self._on_load_error(exc)
            return
        self.ready.set()
        if self._on_ready:
            self._on_ready()
        self._loop()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while (not self._stop and not self._queue and not self._actions
                       and all(s.job is None for s in self.slots)):
                    self._cond.wait()
                if self._stop:
                    break
            if self._actions:
                self._run_actions()
            with self._cond:
                admit = []
                while True:
                    job, free = self._next_admissible()
                    if job is None:
                        break
                    s = pick_slot(free, keyed(job.prompt_ids, job.images), job.cache_prompt)
                    self._queue.remove(job)
                    s.job, job.slot = job, s.index
                    admit.append(s)
            for s in admit:
                self._admit(s)
            for s in self.slots:
                if s.job is not None and s.job.cancelled:
                    self._end(s)
            active = [s for s in self.slots if s.job is not None]
            if active:
                self._round(active)
        for s in self.slots:
            if s.job is not None:
                self._fail(s, "the server is shutting down", status=503)
        with self._cond:
            while self._queue:
                self._queue.popleft().emit(("error", (503, "the server is shutting down")))
            while self._actions:
                self._actions.popleft()[2].set_exception(RuntimeError("the server is shutting down"))

    def _next_admissible(self):
        """The queued job to admit next and its free slots, or ``(None, None)``: in arrival order,
        except that a job of a request (``group``) that already has jobs running waits behind the
        jobs of requests that have fewer (a request of 2,000 prompts or 16 choices takes its share of
        the slots, not all of them until it is done); a job waiting for its slot lets others pass.
        Called with ``_cond`` held."""
        if all(s.job is not None for s in self.slots):
            return None, None  # every round with a full house: no need to look at the queue
        running: dict[int, int] = {}
        for s in self.slots:
            if s.job is not None and s.job.group is not None:
                running[s.job.group] = running.get(s.job.group, 0) + 1
        best, best_key, best_free = None, None, None
        seen: set[int] = set()
        for i, job in enumerate(self._queue):
            if job.group is not None:
                if job.group in seen:  # only a request's first queued job competes
                    continue
                seen.add(job.group)
            free = [s for s in self.slots if s.job is None and job.want_slot in (-1, s.index)]
            if not free:
                continue
            key = (running.get(job.group, 0) if job.group is not None else 0, i)
            if best_key is None or key < best_key:
                best, best_key, best_free = job, key, free
                if key[0] == 0:
                    break  # nothing beats the earliest job of a request with none running
        return best, best_free

    def _admit(self, s: Slot) -> None:
        job = s.job
        self.planner.new_request(s.index)
        try:
            s.use_p_min(job.options.p_min)
            job.state = RequestState(self.engine, job.prompt_ids, job.options, s.drafter, job.stats, cache=s.cache,
                                     images=job.images)
            # against the tokens the state runs (a context shift may have cut the prompt)
            reuse = common_prefix(s.cached, job.state.cache_keys()) if job.cache_prompt else 0
            s.cached = []  # the cache changes from here on
            progress = None
            if job.progress:
                def progress(total, cache, processed, ms):
                    if not job.cancelled:
                        job.emit(("progress", {"total": total, "cache": cache, "processed": processed, "time_ms": ms}))
            events = job.state.prefill(lambda: job.cancelled, reuse, progress)
            job.cache_n = job.state.reused
        except GemmaspecError as exc:
            self._fail(s, str(exc), status=400)
            return
        except Exception as exc:  # noqa: BLE001 - one request's failure must not stop the server
            log.exception("%s: prefill failed", job.name)
            self._fail(s, f"internal error: {type(exc).__name__}: {exc}")
            return
        self._emit(job, events)
        if job.state.done:
            self._end(s)

    def _round(self, active: list[Slot]) -> None:
        rounds, live = [], []
        try:
            begun = self.planner.begin([(s.index, s.job.state) for s in active])
        except Exception as exc:  # noqa: BLE001 - planning itself failed: this round's requests fail
            begun = [exc] * len(active)
        for s, got in zip(active, begun):
            if isinstance(got, BaseException):
                log.error("%s: drafting failed", s.job.name, exc_info=got)
                self._fail(s, f"internal error: {type(got).__name__}: {got}")
            else:
                rounds.append(got)
                live.append(s)
        if not live:
            return
        t_forward = time.perf_counter()
        finished: set[int] = set()
        model = self.engine.model
        if self.metrics is not None:
            for _ in range(1 if self.batched else len(live)):
                self.metrics.decode(len(live) if self.batched else 1)
        try:
            if self.batched:
                outs = model.forward_batch([(r.tokens, s.cache) for r, s in zip(rounds, live)],
                                           [r.all_logits for r in rounds])
            else:
                outs = [model.forward(r.tokens, s.cache, all_logits=r.all_logits) for r, s in zip(rounds, live)]
        except Exception as exc:  # noqa: BLE001
            log.exception("batched forward failed")
            for s in live:
                self._fail(s, f"internal error: {type(exc).__name__}: {exc}")
            return
        for s, out in zip(live, outs):
            job = s.job
            try:
                events = job.state.finish_round(out)
            except Exception as exc:  # noqa: BLE001
                log.exception("%s: verification failed", job.name)
                self._fail(s, f"internal error: {type(exc).__name__}: {exc}")
                continue
            finished.add(s.index)
            self._emit(job, events)
            if job.state.done:
                self._end(s)
        self.planner.finish(time.perf_counter() - t_forward, finished)
        if self.metrics is not None:
            self.metrics.planned(self.planner)

    def _emit(self, job: Job, events: list[Event]) -> None:
        if not events or job.cancelled:
            return
        if job.t_first is None and any(e.tokens for e in events):
            job.t_first = time.perf_counter()
        job.emit(("events", events))

    def _end(self, s: Slot) -> None:
        job = s.job
        s.use_p_min(None)
        if job.cancelled and job.state is not None:
            job.state.cancel()
        if job.state is not None:
            job.stop_word = job.state.stop.word
            s.cached = job.state.cache_keys()[:s.cache.length]
            job.n_cached = len(s.cached)
        job.t_done = s.last_used = time.perf_counter()
        with self._cond:
            s.job = None
            s.served += 1
            s.last = job
        st = job.stats
        if self.metrics is not None:
            self.metrics.record(job)
        log.log(logging.DEBUG if job.quiet else logging.INFO,
                "%s: slot %d | prompt %d tokens, prefill %.1f tokens/s | generated %d tokens, %s | "
                "TTFT %.0f ms | finish %s | %s", job.name, s.index, st.prompt_tokens, st.prefill_tps,
                st.generated_tokens, st.decode_text, job.ttft_ms, st.stop_reason,
                " | ".join([st.spec.llama_line()] + st.spec.drafter_lines()
                           + ([st.spec.chosen_text()] if st.spec.chosen_n else [])))
        if not job.cancelled:
            job.emit(("done", job))

    def _fail(self, s: Slot, message: str, status: int = 500) -> None:
        job = s.job
        s.use_p_min(None)
        s.cached = []
        job.t_done = s.last_used = time.perf_counter()
        with self._cond:
            s.job = None
        if self.metrics is not None:
            self.metrics.failed(job.endpoint)
        if not job.cancelled:
            job.emit(("error", (status, message)))
