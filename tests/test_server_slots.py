"""More of llama-server's behaviour (issue 13): a streamed request whose client leaves during prefill
frees its slot before the prompt is done; several prompts in one ``/completion`` request; slot save /
restore / erase with ``--slot-save-path`` (501 without it); the Host check for a wildcard bind."""

from __future__ import annotations

import json
import os
import re
import socket
import time

import httpx
import pytest
from starlette.testclient import TestClient

from conftest import ServerProcess
from gemmaspec.server.api import ServeConfig, create_app
from gemmaspec.server.security import host_allowed, host_names

CTX = 2048


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    d = tmp_path_factory.mktemp("serve-slots")
    s = ServerProcess(d, "-np", "2", "-c", str(CTX), "--temp", "0", "--slot-save-path", str(d / "slots"))
    s.save_dir = d / "slots"
    yield s
    s.close()


def _post(srv, path, body):
    return httpx.post(srv.url + path, json=body, timeout=120)


def _idle(srv):
    deadline = time.monotonic() + 60
    while any(s["is_processing"] for s in httpx.get(srv.url + "/slots").json()):
        assert time.monotonic() < deadline, "a slot stayed busy"
        time.sleep(0.05)


# ---- a streamed client that leaves during prefill ---------------------------------------------------------

def test_streamed_request_dropped_during_prefill_frees_its_slot_before_the_prompt_is_done(srv):
    prompt = "The quick brown fox jumps over the lazy dog. " * 180  # ~1800 tokens: 8 prefill chunks
    n = len(_post(srv, "/tokenize", {"content": prompt, "add_special": True}).json()["tokens"])
    assert 1500 < n < CTX
    body = {"prompt": prompt, "max_tokens": 8, "stream": True, "cache_prompt": False}
    with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200  # headers are out before the first token: the client leaves now
    _idle(srv)
    line = [ln for ln in srv.log().splitlines() if f"prompt {n} tokens" in ln]
    assert line and "finish cancelled" in line[-1] and "generated 0 tokens" in line[-1], line
    ok = _post(srv, "/v1/completions", {"prompt": "Hi", "max_tokens": 2})  # and the server goes on
    assert ok.status_code == 200


# ---- several prompts in one /completion request ----------------------------------------------------------

def test_several_prompts_in_one_completion_request(srv, tokenizer):
    prompts = ["The capital of France is", "One, two, three,", [tokenizer.bos_id, *tokenizer.encode("Red, green,", add_bos=False)]]
    single = [_post(srv, "/completion", {"prompt": p, "n_predict": 6, "cache_prompt": False}).json() for p in prompts]
    many = _post(srv, "/completion", {"prompt": prompts, "n_predict": 6, "cache_prompt": False}).json()
    assert isinstance(many, list) and [m["index"] for m in many] == [0, 1, 2]
    assert [m["content"] for m in many] == [s["content"] for s in single]
    assert all(m["tokens_predicted"] == 6 and m["stop"] for m in many)
    with httpx.stream("POST", srv.url + "/completion", timeout=120,
                      json={"prompt": prompts[:2], "n_predict": 6, "cache_prompt": False, "stream": True}) as r:
        events = [json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: {")]
    for i in (0, 1):
        mine = [e for e in events if e["index"] == i]
        assert "".join(e["content"] for e in mine) == single[i]["content"] and mine[-1]["stop"] is True
    one = _post(srv, "/completion", {"prompt": ["Hello"], "n_predict": 2}).json()
    assert isinstance(one, dict)  # a list of one prompt answers one result, as llama-server does
    bad = _post(srv, "/completion", {"prompt": ["fine", [1, [2]]], "n_predict": 2})
    assert bad.status_code == 400


# ---- slot save / restore / erase -------------------------------------------------------------------------

def test_slot_save_erase_restore_reuses_the_saved_prompt(srv):
    _idle(srv)
    prompt = "Alice and Bob are talking about the weather in a small town by the sea. " * 6
    first = _post(srv, "/completion", {"prompt": prompt, "n_predict": 4, "id_slot": 1}).json()
    n = first["tokens_evaluated"] + first["tokens_predicted"] - 1  # the last token is never run through the model
    saved = _post(srv, "/slots/1?action=save", {"filename": "talk.bin"}).json()
    assert saved["id_slot"] == 1 and saved["n_saved"] == n and saved["n_written"] > 0 and "save_ms" in saved["timings"]
    assert (srv.save_dir / "talk.bin").stat().st_size == saved["n_written"]
    assert _post(srv, "/slots/1?action=erase", {}).json() == {"id_slot": 1, "n_erased": n}
    cold = _post(srv, "/completion", {"prompt": prompt, "n_predict": 4, "id_slot": 1, "cache_prompt": False}).json()
    assert cold["timings"]["cache_n"] == 0
    _post(srv, "/slots/1?action=erase", {})
    restored = _post(srv, "/slots/1?action=restore", {"filename": "talk.bin"}).json()
    assert restored["n_restored"] == n and restored["n_read"] == saved["n_written"]
    again = _post(srv, "/completion", {"prompt": prompt, "n_predict": 4, "id_slot": 1}).json()
    assert again["timings"]["cache_n"] == first["tokens_evaluated"] - 1  # all but the last prompt token reused
    assert again["content"] == cold["content"]


@pytest.mark.parametrize("path,body,status,needle", [
    ("/slots/0?action=save", {"filename": "../escape.bin"}, 400, "filename"),
    ("/slots/0?action=save", {"filename": ".hidden"}, 400, "filename"),
    ("/slots/0?action=save", {}, 400, "filename"),
    ("/slots/0?action=restore", {"filename": "missing.bin"}, 400, "missing.bin"),
    ("/slots/0?action=explode", {}, 400, "explode"),
    ("/slots/7?action=erase", {}, 400, "slot"),
])
def test_slot_actions_refuse_bad_input(srv, path, body, status, needle):
    r = _post(srv, path, body)
    assert r.status_code == status and needle in r.json()["error"]["message"], r.text
    assert not (srv.save_dir.parent / "escape.bin").exists()


def test_restore_refuses_a_file_that_is_not_a_slot(srv):
    (srv.save_dir / "junk.bin").write_bytes(b"not a slot")
    r = _post(srv, "/slots/0?action=restore", {"filename": "junk.bin"})
    assert r.status_code == 400 and "junk.bin" in r.json()["error"]["message"]


# ---- slot files never leave --slot-save-path (issue 33: links planted in the directory) -----------------

def _outside(srv, name, data=b"precious, not a slot"):
    p = srv.save_dir.parent / name
    p.write_bytes(data)
    return p


def test_save_refuses_a_symlink_at_the_slot_name_and_leaves_its_target_alone(srv):
    target = _outside(srv, "outside-save.bin")
    (srv.save_dir / "linked.bin").symlink_to(target)
    r = _post(srv, "/slots/0?action=save", {"filename": "linked.bin"})
    assert r.status_code == 400 and "linked.bin" in r.json()["error"]["message"], r.text
    assert "symbolic link" in r.json()["error"]["message"]
    assert target.read_bytes() == b"precious, not a slot"
    assert (srv.save_dir / "linked.bin").is_symlink()
    dangling = srv.save_dir.parent / "created-outside.bin"
    (srv.save_dir / "dangling.bin").symlink_to(dangling)
    assert _post(srv, "/slots/0?action=save", {"filename": "dangling.bin"}).status_code == 400
    assert not dangling.exists()
    assert not [p.name for p in srv.save_dir.iterdir() if p.name.endswith(".tmp")]  # no temporary file left


def test_save_never_writes_through_a_link_at_a_temporary_name(srv):
    # the old temporary name was the slot's name + ".tmp"; temporary files are now created exclusively
    # under random names, so a link planted at any other name is never opened
    target = _outside(srv, "outside-tmp.bin")
    (srv.save_dir / "fresh.bin.tmp").symlink_to(target)
    r = _post(srv, "/slots/0?action=save", {"filename": "fresh.bin"})
    assert r.status_code == 200, r.text
    assert target.read_bytes() == b"precious, not a slot"
    fresh = srv.save_dir / "fresh.bin"
    assert fresh.is_file() and not fresh.is_symlink() and fresh.stat().st_size == r.json()["n_written"]
    assert _post(srv, "/slots/0?action=restore", {"filename": "fresh.bin"}).status_code == 200  # round trip


def test_restore_refuses_a_symlink_to_a_slot_file_outside(srv):
    assert _post(srv, "/slots/0?action=save", {"filename": "real.bin"}).status_code == 200
    outside = srv.save_dir.parent / "outside-slot.bin"
    (srv.save_dir / "real.bin").rename(outside)  # a valid slot file, now outside the directory
    (srv.save_dir / "pointer.bin").symlink_to(outside)
    r = _post(srv, "/slots/0?action=restore", {"filename": "pointer.bin"})
    assert r.status_code == 400 and "pointer.bin" in r.json()["error"]["message"], r.text
    assert "symbolic link" in r.json()["error"]["message"]


def test_save_and_restore_refuse_entries_that_are_not_regular_files(srv):
    (srv.save_dir / "adir.bin").mkdir()
    r = _post(srv, "/slots/0?action=save", {"filename": "adir.bin"})
    assert r.status_code == 400 and "adir.bin" in r.json()["error"]["message"], r.text
    assert not list((srv.save_dir / "adir.bin").iterdir())
    os.mkfifo(srv.save_dir / "pipe.bin")  # opening a FIFO for reading would block the scheduler
    r = httpx.post(srv.url + "/slots/0?action=restore", json={"filename": "pipe.bin"}, timeout=30)
    assert r.status_code == 400 and "pipe.bin" in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("bad", [b"caf\xe9.bin", b"x\xe2\x82.bin", b"x\xed\xa0\x80.bin"], ids=["latin1", "cut", "surrogate"])
@pytest.mark.parametrize("action", ["save", "restore"])
def test_slot_actions_refuse_bytes_that_are_not_utf8(srv, action, bad):
    """The slot route reads a JSON body too (issue 33, item 1: every route): a 400 naming UTF-8, no file."""
    before = sorted(p.name for p in srv.save_dir.iterdir())
    r = httpx.post(srv.url + f"/slots/0?action={action}", content=b'{"filename": "' + bad + b'"}',
                   headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == 400 and "not valid UTF-8" in r.json()["error"]["message"], r.text
    assert sorted(p.name for p in srv.save_dir.iterdir()) == before


def test_slot_actions_without_a_save_path_are_501():
    client = TestClient(create_app(ServeConfig()), base_url="http://localhost")  # no lifespan: the model never loads; the check comes first
    r = client.post("/slots/0?action=save", json={"filename": "x.bin"})
    assert r.status_code == 501 and "--slot-save-path" in r.json()["error"]["message"]
    assert r.json()["error"]["type"] == "not_supported_error"


# ---- the Host check for a wildcard bind -----------------------------------------------------------------

def test_a_wildcard_bind_answers_the_machines_names_and_addresses_but_not_rebinding_names():
    names = frozenset(host_names("0.0.0.0", ("my-lan-name",)))
    me, fqdn = socket.gethostname().lower(), socket.getfqdn().lower()
    for host in (f"{me}:8085", fqdn, "192.168.1.20:8085", "[fe80::1]:8085", "localhost:8085", "My-LAN-Name"):
        assert host_allowed(host, names), host
    for host in ("evil.example", f"{me}.evil.example:8085", "rebind.attacker.test"):
        assert not host_allowed(host, names), host
    assert "0.0.0.0" not in names and not re.search(r"^::$", " ".join(names))
    local = frozenset(host_names("127.0.0.1"))
    assert not host_allowed(f"{me}.evil.example", local)
    client = TestClient(create_app(ServeConfig(allowed_hosts=host_names("0.0.0.0"))))
    assert client.get("/metrics", headers={"Host": f"{me}:8085"}).status_code == 200
    assert client.get("/metrics", headers={"Host": "10.0.0.5:8085"}).status_code == 200
    r = client.get("/metrics", headers={"Host": "evil.example:8085"})
    assert r.status_code == 400 and "--allowed-hosts" in r.json()["error"]["message"]
