"""What the command line reports about a request: the human stats line and the ``--json`` record.

Both are built from a :class:`~gemmaspec.engine.RequestStats`; the CLI's ``generate`` and ``chat``
share them so the two commands print the same thing.
"""

from __future__ import annotations


def stats_line(stats, load_s: float | None = None) -> str:
    """One human-readable line: ``load 1.09 s | prompt 13 tokens, prefill 256.0 tokens/s | generated 128
    tokens, decode 51.4 tokens/s | TTFT 51 ms | stop: length | seed 42`` (``load`` only when given)."""
    head = f"load {load_s:.2f} s | " if load_s is not None else ""
    return (f"{head}prompt {stats.prompt_tokens} tokens, prefill {stats.prefill_tps:.1f} tokens/s | "
            f"generated {stats.generated_tokens} tokens, {stats.decode_text} | "
            f"TTFT {stats.ttft_ms:.0f} ms | stop: {stats.stop_reason} | seed {stats.seed}")


def stats_record(stats, load_s: float, spec_type: str, n_max) -> dict:
    """The ``generate --json`` record (JSON-serialisable).

    Keys: ``prompt_tokens``, ``generated_tokens`` (ints); ``prefill_tps``, ``decode_tps`` (tokens/s;
    ``decode_tps`` is None below two generated tokens); ``prefill_ms``, ``decode_ms``, ``ttft_ms``
    (milliseconds); ``load_s`` (seconds: model load and preparation); ``stop_reason`` ("eos", "stop",
    "length", "context"); ``truncated`` (a context shift cut the prompt or dropped tokens); ``seed``; ``spec_type`` (the drafter that ran, e.g. ``ngram-simple,draft-mtp`` for ``--spec-type default``
    with the default model), ``n_max`` (int or "auto"); ``drafted``, ``accepted``
    (draft tokens), ``verify_steps``, ``acceptance_rate`` (accepted / drafted, 0 when none drafted) and
    ``mean_accepted_length`` (tokens per verify step, the target's own token included); with a list of
    types (``ngram-simple,draft-mtp``) also ``by_drafter``: per drafter, in the list's order, the same five
    keys from ``drafted`` to ``mean_accepted_length``.
    """
    sp = stats.spec

    def counts(st) -> dict:
        return {"drafted": st.drafted, "accepted": st.accepted, "verify_steps": st.steps,
                "acceptance_rate": round(st.acceptance_rate, 5), "mean_accepted_length": round(st.mean_accepted_length, 4)}

    by = sp.to_dict().get("by_drafter", {})  # the list's order
    return {
        "prompt_tokens": stats.prompt_tokens, "generated_tokens": stats.generated_tokens,
        "prefill_tps": round(stats.prefill_tps, 3),
        "decode_tps": round(stats.decode_tps, 3) if stats.generated_tokens >= 2 and stats.decode_ms > 0 else None,
        "prefill_ms": round(stats.prefill_ms, 3), "decode_ms": round(stats.decode_ms, 3),
        "ttft_ms": round(stats.ttft_ms, 3), "load_s": round(load_s, 4), "stop_reason": stats.stop_reason,
        "truncated": stats.truncated, "seed": stats.seed, "spec_type": spec_type, "n_max": n_max, **counts(sp),
    } | ({"by_drafter": {name: counts(sp.by_drafter[name]) for name in by}} if by else {})
