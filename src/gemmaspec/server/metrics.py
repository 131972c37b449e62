"""Prometheus metrics of the server (``GET /metrics``), on a registry of its own.

Counters (Prometheus adds ``_total``): ``gemmaspec_requests_total{endpoint, finish_reason}``,
``gemmaspec_request_errors_total{endpoint}``, ``gemmaspec_prompt_tokens_total``,
``gemmaspec_generation_tokens_total``, and the speculative-decoding counters under vLLM's names:
``spec_decode_num_drafts_total`` (verify steps that had drafts), ``spec_decode_num_draft_tokens_total``,
``spec_decode_num_accepted_tokens_total`` and ``spec_decode_num_accepted_tokens_per_pos_total{position}``
(position 0 = the first draft token of a round). Gauges: ``gemmaspec_requests_running``,
``gemmaspec_requests_waiting``. Histogram: ``gemmaspec_time_to_first_token_seconds`` (arrival → first
token, queueing included), ``gemmaspec_forward_batch_size`` (requests sharing each decode forward).

The same figures under llama-server's names too, so its dashboards work: ``llamacpp:prompt_tokens_total``,
``llamacpp:prompt_tokens_cached_total`` (reused from a slot's cache), ``llamacpp:prompt_seconds_total``,
``llamacpp:tokens_predicted_total``,
``llamacpp:tokens_predicted_seconds_total``, ``llamacpp:prompt_tokens_seconds`` and
``llamacpp:predicted_tokens_seconds`` (average throughputs), ``llamacpp:requests_processing``,
``llamacpp:requests_deferred``, ``llamacpp:n_decode_total`` (target forwards), ``llamacpp:n_tokens_max``
(the longest sequence seen, prompt + generated),
``llamacpp:n_busy_slots_per_decode`` and ``llamacpp:spec_decode_num_{drafts,draft_tokens,accepted_tokens}_total``,
``llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position}``.

The draft lengths chosen per round from measured costs (:mod:`gemmaspec.speculative.chooser`):
histogram ``gemmaspec_spec_draft_n_chosen`` (one observation per slot and round), gauge
``gemmaspec_spec_draft_n{slot}`` (the slot's last), counters ``gemmaspec_spec_planned_rounds_total``,
``gemmaspec_spec_predicted_tokens_total`` / ``gemmaspec_spec_predicted_seconds_total`` (what the cost model
expected of those rounds) and ``gemmaspec_spec_round_tokens_total`` / ``gemmaspec_spec_round_seconds_total``
(what they kept and took), gauges ``gemmaspec_spec_predicted_tokens_per_second`` and
``gemmaspec_spec_measured_tokens_per_second`` (the last such round).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401 - re-exported for the app


class Metrics:
    """The server's counters. ``running`` and ``waiting`` are callables read at scrape time."""

    def __init__(self, running=lambda: 0, waiting=lambda: 0):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("gemmaspec_requests", "Finished requests", ["endpoint", "finish_reason"], registry=r)
        self.errors = Counter("gemmaspec_request_errors", "Requests refused or failed", ["endpoint"], registry=r)
        self.prompt_tokens = Counter("gemmaspec_prompt_tokens", "Prompt tokens processed", registry=r)
        self.generation_tokens = Counter("gemmaspec_generation_tokens", "Tokens generated", registry=r)
        self.drafts = Counter("spec_decode_num_drafts", "Verify steps with at least one draft token", registry=r)
        self.draft_tokens = Counter("spec_decode_num_draft_tokens", "Draft tokens proposed", registry=r)
        self.accepted = Counter("spec_decode_num_accepted_tokens", "Draft tokens accepted", registry=r)
        self.accepted_per_pos = Counter("spec_decode_num_accepted_tokens_per_pos",
                                        "Draft tokens accepted, by position in the round (0 = first)",
                                        ["position"], registry=r)
        self.ttft = Histogram("gemmaspec_time_to_first_token_seconds", "Arrival to first token (queueing included)",
                              buckets=(0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60), registry=r)
        self.batch_size = Histogram("gemmaspec_forward_batch_size", "Requests sharing one target forward",
                                    buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32), registry=r)
        # the draft length chosen per slot and round from measured costs (speculative/chooser.py)
        self.chosen = Histogram("gemmaspec_spec_draft_n_chosen", "Draft length chosen for a slot's round",
                                buckets=(0, 1, 2, 3, 4, 6, 8, 12, 15), registry=r)
        self.slot_n = Gauge("gemmaspec_spec_draft_n", "Draft length chosen for the slot's last round",
                            ["slot"], registry=r)
        self.plan_rounds = Counter("gemmaspec_spec_planned_rounds", "Rounds whose draft lengths were chosen",
                                   registry=r)
        self.pred_tokens = Counter("gemmaspec_spec_predicted_tokens", "Tokens the cost model expected of them",
                                   registry=r)
        self.pred_seconds = Counter("gemmaspec_spec_predicted_seconds", "Seconds the cost model expected of them",
                                    registry=r)
        self.round_tokens = Counter("gemmaspec_spec_round_tokens", "Tokens those rounds kept", registry=r)
        self.round_seconds = Counter("gemmaspec_spec_round_seconds", "Seconds those rounds took (drafting "
                                     "included)", registry=r)
        self._rates = [0.0, 0.0]
        Gauge("gemmaspec_spec_predicted_tokens_per_second", "The cost model's tokens/s for the last chosen round",
              registry=r).set_function(lambda: self._rates[0])
        Gauge("gemmaspec_spec_measured_tokens_per_second", "Measured tokens/s of the last chosen round",
              registry=r).set_function(lambda: self._rates[1])
        self._plan_seen = None
        Gauge("gemmaspec_requests_running", "Requests in a slot", registry=r).set_function(running)
        Gauge("gemmaspec_requests_waiting", "Requests queued for a slot", registry=r).set_function(waiting)
        # llama-server's names
        self.l_prompt = Counter("llamacpp:prompt_tokens", "Number of prompt tokens processed", registry=r)
        self.l_prompt_cached = Counter("llamacpp:prompt_tokens_cached",
                                       "Number of prompt tokens reused from a slot's cache", registry=r)
        self.l_prompt_s = Counter("llamacpp:prompt_seconds", "Prompt process time in seconds", registry=r)
        self.l_pred = Counter("llamacpp:tokens_predicted", "Number of generation tokens processed", registry=r)
        self.l_pred_s = Counter("llamacpp:tokens_predicted_seconds", "Predict process time in seconds", registry=r)
        self.l_decode = Counter("llamacpp:n_decode", "Number of target forwards (llama_decode calls)", registry=r)
        self.l_drafts = Counter("llamacpp:spec_decode_num_drafts", "Speculative verification steps", registry=r)
        self.l_draft_tokens = Counter("llamacpp:spec_decode_num_draft_tokens", "Draft tokens generated", registry=r)
        self.l_accepted = Counter("llamacpp:spec_decode_num_accepted_tokens", "Draft tokens accepted", registry=r)
        self.l_accepted_pos = Counter("llamacpp:spec_decode_num_accepted_tokens_per_pos",
                                      "Accepted tokens per draft position", ["position"], registry=r)
        self._busy = self._decodes = 0
        self.n_tokens_max = 0  # longest sequence seen (prompt + generated), llama-server's n_tokens_max
        self._sums = {"prompt": 0.0, "prompt_s": 0.0, "pred": 0.0, "pred_s": 0.0}
        sm = self._sums
        Gauge("llamacpp:prompt_tokens_seconds", "Average prompt throughput in tokens/s", registry=r).set_function(
            lambda: sm["prompt"] / sm["prompt_s"] if sm["prompt_s"] > 0 else 0.0)
        Gauge("llamacpp:predicted_tokens_seconds", "Average generation throughput in tokens/s",
              registry=r).set_function(lambda: sm["pred"] / sm["pred_s"] if sm["pred_s"] > 0 else 0.0)
        Gauge("llamacpp:requests_processing", "Number of requests processing", registry=r).set_function(running)
        Gauge("llamacpp:requests_deferred", "Number of requests deferred", registry=r).set_function(waiting)
        Gauge("llamacpp:n_busy_slots_per_decode", "Average number of busy slots per target forward",
              registry=r).set_function(lambda: self._busy / self._decodes if self._decodes else 0.0)

    def decode(self, busy: int) -> None:
        """Count one target forward shared by ``busy`` requests."""
        self.batch_size.observe(busy)
        self.l_decode.inc()
        self._decodes += 1
        self._busy += busy

    def planned(self, planner) -> None:
        """Count the round a :class:`~gemmaspec.speculative.planner.RoundPlanner` just finished: the
        lengths chosen and its totals (predicted and measured tokens and seconds)."""
        t = planner.totals
        if t.rounds == (self._plan_seen or [0])[0]:
            return
        before = self._plan_seen or [0, 0.0, 0.0, 0, 0.0]
        now = [t.rounds, t.predicted_tokens, t.predicted_seconds, t.tokens, t.seconds]
        for counter, a, b in zip((self.plan_rounds, self.pred_tokens, self.pred_seconds, self.round_tokens,
                                  self.round_seconds), now, before):
            counter.inc(max(0, a - b))
        self._plan_seen = now
        for slot, n in planner.round_choices():
            self.chosen.observe(n)
            self.slot_n.labels(str(slot)).set(n)
        self._rates[:] = planner.last_rate

    def record(self, job) -> None:
        """Count a finished (or cancelled) request: its tokens and speculative rounds."""
        st = job.stats
        self.requests.labels(job.endpoint, st.stop_reason or "unknown").inc()
        self.prompt_tokens.inc(st.prompt_tokens)
        self.generation_tokens.inc(st.generated_tokens)
        self.drafts.inc(st.spec.steps)
        self.draft_tokens.inc(st.spec.drafted)
        self.accepted.inc(st.spec.accepted)
        for i, n in enumerate(st.spec.accepted_per_pos):
            self.accepted_per_pos.labels(str(i)).inc(n)
            self.l_accepted_pos.labels(str(i)).inc(n)
        sm = self._sums
        for key, counter, v in (("prompt", self.l_prompt, st.prompt_tokens - job.cache_n),
                                ("prompt_s", self.l_prompt_s, st.prefill_ms / 1e3),
                                ("pred", self.l_pred, st.generated_tokens), ("pred_s", self.l_pred_s, st.decode_ms / 1e3)):
            counter.inc(v)
            sm[key] += v
        self.l_prompt_cached.inc(job.cache_n)
        self.n_tokens_max = max(self.n_tokens_max, st.prompt_tokens + st.generated_tokens)
        self.l_drafts.inc(st.spec.steps)
        self.l_draft_tokens.inc(st.spec.drafted)
        self.l_accepted.inc(st.spec.accepted)
        if job.t_first is not None:
            self.ttft.observe(job.ttft_ms / 1e3)

    def failed(self, endpoint: str) -> None:
        self.errors.labels(endpoint).inc()

    def exposition(self) -> bytes:
        """The text format Prometheus scrapes (``llamacpp:n_tokens_max`` is written by hand: llama-server
        types it a counter without the ``_total`` suffix, which prometheus_client always adds)."""
        return generate_latest(self.registry) + (
            "# HELP llamacpp:n_tokens_max Largest observed sequence length (prompt + generation)\n"
            "# TYPE llamacpp:n_tokens_max counter\n"
            f"llamacpp:n_tokens_max {float(self.n_tokens_max)}\n").encode()
