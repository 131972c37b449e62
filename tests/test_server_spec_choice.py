"""The server's default: each round's draft length chosen per slot from measured costs. Several users at
once get exactly the output they get with speculation off (greedy); the choice shows in ``/slots``,
``/metrics``, ``/props`` and the request's log line; ``speculative.n_fixed`` opts a request out."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx

PROMPTS = ["def fibonacci(n):\n    if n <", "Rewrite the list: red, green, blue, red, green, blue, red,",
           "The history of the printing press", "1, 2, 3, 4, 5, 6,"]


def _complete(server, prompt, **extra):
    body = {"prompt": prompt, "n_predict": 24, "temperature": 0, "return_tokens": True, "cache_prompt": False,
            **extra}
    r = httpx.post(server.url + "/completion", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def _metrics(server) -> dict[str, float]:
    out = {}
    for line in httpx.get(server.url + "/metrics", timeout=30).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_chosen_lengths_give_the_output_of_no_speculation_with_users_at_once(server):
    before = _metrics(server)
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        chosen = list(pool.map(lambda p: _complete(server, p), PROMPTS))
        off = list(pool.map(lambda p: _complete(server, p, **{"speculative.n_max": 0}), PROMPTS))
    assert chosen == off
    assert all(len(t) == 24 for t in chosen)
    after = _metrics(server)
    rounds = after["gemmaspec_spec_planned_rounds_total"] - before.get("gemmaspec_spec_planned_rounds_total", 0)
    assert rounds > 0
    assert after["gemmaspec_spec_draft_n_chosen_count"] > before.get("gemmaspec_spec_draft_n_chosen_count", 0)
    assert after["gemmaspec_spec_predicted_seconds_total"] > 0 and after["gemmaspec_spec_round_seconds_total"] > 0
    assert any(k.startswith('gemmaspec_spec_draft_n{slot="') for k in after)
    assert "gemmaspec_spec_predicted_tokens_per_second" in after


def test_slots_props_and_log_show_the_choice(server):
    _complete(server, PROMPTS[0])
    slots = httpx.get(server.url + "/slots", timeout=30).json()
    shown = [s for s in slots if s["draft_n_chosen"] is not None]
    assert shown and all(isinstance(s["draft_n_chosen"], int) for s in shown)
    assert all({"n", "source", "acceptance"} <= set(s["draft_choice"]) for s in shown)
    props = httpx.get(server.url + "/props", timeout=30).json()
    assert props["speculative"]["n_chosen"] is True
    assert "draft n chosen: " in server.log()


def test_a_request_can_draft_its_fixed_length(server):
    fixed = _complete(server, PROMPTS[1], **{"speculative.n_fixed": True, "speculative.n_max": 2})
    assert fixed == _complete(server, PROMPTS[1], **{"speculative.n_max": 0})
    r = httpx.post(server.url + "/completion", json={"prompt": "x", "speculative.n_fixed": "yes"}, timeout=60)
    assert r.status_code == 400 and "speculative.n_fixed" in r.text
