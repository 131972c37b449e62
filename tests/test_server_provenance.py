"""`return_provenance`: where each generated token came from (an accepted draft of a named drafter, or
the target's own token), streamed per chunk and in whole responses, on the default server (the embedded
model, `ngram-simple,draft-mtp`, n-max 3); off unless asked for. The counts agree with the response's
own acceptance figures, and each round's entries fit together."""

from __future__ import annotations

import json

import httpx

# greedy, the default model's continuation repeats some phrases (n-gram lookup drafts them) and not
# others (the MTP assistant drafts there): both drafters have drafts accepted and rejected
PROMPT = "The history of the city of Paris begins"
DRAFTERS = {"ngram-simple", "draft-mtp"}


def _stream(server, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", server.url + path, json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(ln[5:]) for ln in r.iter_lines() if ln.startswith("data:") and ln[5:].strip() != "[DONE]"]


def _check_rounds(entries: list[dict]) -> None:
    """Each round: accepted drafts at pos 0, 1, ... of one drafter, then the target's token at pos =
    drafts accepted, replacing drafted - pos rejected drafts (greedy: the first of them differs from it)."""
    expect_pos, drafter = 0, None
    for e in entries:
        assert e["pos"] == expect_pos, entries
        if e["source"] == "target":
            if e["drafted"]:
                assert drafter in (None, e["drafter"]) and e["drafter"] in DRAFTERS, e
                assert len(e["rejected_ids"]) == len(e["rejected"]) == e["drafted"] - e["pos"], e
                if e["rejected_ids"]:
                    assert e["rejected_ids"][0] != e["id"], e
            else:
                assert e["pos"] == 0 and "rejected" not in e and "drafter" not in e, e
            expect_pos, drafter = 0, None
        else:
            assert e["source"] in DRAFTERS and e["pos"] < e["drafted"], e
            assert drafter in (None, e["source"]), entries
            expect_pos, drafter = e["pos"] + 1, e["source"]


def test_streamed_provenance_agrees_with_the_acceptance_figures(server):
    chunks = _stream(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 64, "temperature": 0,
                                                 "ignore_eos": True, "return_provenance": True,
                                                 "speculative.n_fixed": True})  # both drafters draft, whatever the load
    with_tokens = [c for c in chunks if c["choices"] and "provenance" in c["choices"][0]]
    entries = [e for c in with_tokens for e in c["choices"][0]["provenance"]]
    last = chunks[-1]
    t, usage = last["timings"], last["usage"]
    assert len(entries) == usage["completion_tokens"] == 64
    assert all(len(c["choices"][0]["provenance"]) == 1 for c in with_tokens)  # one token per chunk
    sources = [e["source"] for e in entries]
    accepted = sum(s != "target" for s in sources)
    assert accepted == t["draft_n_accepted"] > 0
    assert sum(e["drafted"] for e in entries if e["source"] == "target") == t["draft_n"]  # ended by length
    assert DRAFTERS <= set(sources), sources  # both drafters of the default list had drafts accepted
    _check_rounds(entries)
    rejected = [e for e in entries if e.get("rejected_ids")]
    assert rejected
    for e in rejected[:3]:  # the rejected texts are those tokens' texts
        text = httpx.post(server.url + "/detokenize", json={"tokens": e["rejected_ids"][:1]}).json()["content"]
        assert e["rejected"][0] == text


def test_provenance_is_off_unless_asked_for(server):
    body = {"prompt": PROMPT, "max_tokens": 16, "temperature": 0}
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=120) as r:
        raw = r.read().decode()
    assert raw.count("data:") > 16 and "provenance" not in raw and "rejected" not in raw
    whole = httpx.post(server.url + "/v1/chat/completions", timeout=120,
                       json={"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 8}).json()
    assert "provenance" not in json.dumps(whole)
    native = httpx.post(server.url + "/completion", json={"prompt": PROMPT, "n_predict": 8}, timeout=120).json()
    assert "provenance" not in native


def test_no_drafting_means_every_token_is_the_targets(server):
    chunks = _stream(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}],
                                                      "max_tokens": 12, "temperature": 0, "ignore_eos": True,
                                                      "return_provenance": True, "speculative.n_max": 0})
    entries = [e for c in chunks if c["choices"] for e in c["choices"][0].get("provenance", [])]
    assert len(entries) == 12
    assert all(e["source"] == "target" and e["drafted"] == 0 and e["pos"] == 0 for e in entries), entries
    assert chunks[-1]["timings"]["draft_n"] == 0


def test_native_completion_streamed_and_whole(server):
    body = {"prompt": PROMPT, "n_predict": 32, "temperature": 0, "ignore_eos": True, "return_provenance": True,
            "return_tokens": True, "cache_prompt": False,
            "speculative.n_fixed": True}  # fixed draft lengths: the per-round choice follows measured timings
    events = _stream(server, "/completion", body)
    streamed = [e for ev in events for e in ev.get("provenance", [])]
    for ev in events[:-1]:  # each event's entries are its tokens
        assert [e["id"] for e in ev["provenance"]] == ev["tokens"]
    assert "provenance" not in events[-1] and events[-1]["stop"] is True  # the final event carries no tokens
    whole = httpx.post(server.url + "/completion", json=body, timeout=120).json()
    assert [e["id"] for e in whole["provenance"]] == whole["tokens"] == [e["id"] for e in streamed]
    assert sum(e["source"] != "target" for e in whole["provenance"]) == whole["timings"]["draft_n_accepted"]
    assert [e["source"] for e in whole["provenance"]] == [e["source"] for e in streamed]  # greedy, no cache reuse
    _check_rounds(whole["provenance"])
    chat = httpx.post(server.url + "/v1/chat/completions", timeout=120,
                      json={"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 16, "temperature": 0,
                            "ignore_eos": True, "return_provenance": True}).json()
    prov = chat["choices"][0]["provenance"]
    assert len(prov) == chat["usage"]["completion_tokens"] == 16
    assert sum(e["source"] != "target" for e in prov) == chat["timings"]["draft_n_accepted"]
