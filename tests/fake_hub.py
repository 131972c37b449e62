"""A local stand-in for the Hugging Face Hub (127.0.0.1, a thread), serving files in the hub's URL
layout for ``huggingface_hub`` behind ``HF_ENDPOINT``: ``/{repo}/resolve/{rev}/{file}`` (HEAD and GET,
with ``X-Repo-Commit``, the LFS sha256 as ETag, and ``Range``), ``/api/models/{repo}/revision/{rev}``
and ``/api/models/{repo}/tree/{rev}``. It records every request; ``cut[file] = n`` makes the next GET
of that file stop after n bytes (the connection drops mid-body); a request whose ``"METHOD path"``
matches a pattern in ``fail`` (``re.search``) gets no answer at all (the connection drops: a network
failure as the client sees it). ``Range: bytes=a-b`` is served as the hub serves it (206, bytes a..b)."""

from __future__ import annotations

import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class FakeHub:
    def __init__(self):
        self.repos: dict[str, dict[str, bytes]] = {}
        self.requests: list[tuple[str, str, str | None]] = []  # (method, path, Range header)
        self.cut: dict[str, int] = {}
        self.fail: list[str] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def do_HEAD(self):
                hub._handle(self, head=True)

            def do_GET(self):
                hub._handle(self, head=False)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def add(self, repo: str, files: dict[str, bytes]) -> None:
        self.repos.setdefault(repo, {}).update(files)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    @staticmethod
    def sha(data: bytes) -> str:
        return hashlib.sha256(data).hexdigest()

    def _json(self, h, obj, head: bool) -> None:
        body = json.dumps(obj).encode()
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        h.send_header("X-Repo-Commit", COMMIT)
        h.end_headers()
        if not head:
            h.wfile.write(body)

    def _missing(self, h, code="EntryNotFound") -> None:
        body = json.dumps({"error": code}).encode()
        h.send_response(404)
        h.send_header("X-Error-Code", code)
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    def _handle(self, h, head: bool) -> None:
        path = unquote(urlsplit(h.path).path)
        self.requests.append(("HEAD" if head else "GET", path, h.headers.get("Range")))
        if any(re.search(f, f"{'HEAD' if head else 'GET'} {path}") for f in self.fail):
            h.close_connection = True
            try:
                h.connection.shutdown(2)  # no status line: the client sees the connection drop
            except OSError:
                pass
            return
        m = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/(revision|tree)/([^/]+)(?:/.*)?)?", path)
        if m:
            repo, kind = m.group(1), m.group(2)
            if repo not in self.repos:
                return self._missing(h, "RepoNotFound")
            files = self.repos[repo]
            lfs = lambda d: {"sha256": self.sha(d), "size": len(d), "pointerSize": 134}  # noqa: E731
            if kind != "tree":
                return self._json(h, {"id": repo, "modelId": repo, "sha": COMMIT, "private": False,
                                      "siblings": [{"rfilename": f, "size": len(d), "blobId": self.sha(d)[:40],
                                                    "lfs": lfs(d)} for f, d in files.items()]}, head)
            return self._json(h, [{"type": "file", "path": f, "size": len(d), "oid": self.sha(d)[:40],
                                   "lfs": {"oid": self.sha(d), "size": len(d), "pointerSize": 134}}
                                  for f, d in files.items()], head)
        m = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
        if not m or m.group(1) not in self.repos:
            return self._missing(h, "RepoNotFound")
        data = self.repos[m.group(1)].get(m.group(3))
        if data is None:
            return self._missing(h)
        start, end = 0, len(data) - 1
        rng = h.headers.get("Range")
        if rng and not head:
            m2 = re.match(r"bytes=(\d+)-(\d*)", rng)
            start = int(m2.group(1))
            end = min(int(m2.group(2)), end) if m2.group(2) else end
        body = data[start:end + 1]
        ranged = bool(rng) and not head
        h.send_response(206 if ranged else 200)
        h.send_header("Content-Length", str(len(body)))
        if ranged:
            h.send_header("Content-Range", f"bytes {start}-{end}/{len(data)}")
        h.send_header("Accept-Ranges", "bytes")
        h.send_header("ETag", f'"{self.sha(data)}"')
        h.send_header("X-Repo-Commit", COMMIT)
        h.end_headers()
        if head:
            return
        n = self.cut.pop(m.group(3), None)
        if n is not None:
            h.wfile.write(body[:n])
            h.wfile.flush()
            h.close_connection = True
            return
        h.wfile.write(body)


def serve_fake_hub(monkeypatch, home) -> FakeHub:
    """A started :class:`FakeHub` that huggingface_hub talks to (``HF_ENDPOINT``), with a fresh
    ``HF_HOME`` under ``home`` and no offline switch or token from the environment; close it after."""
    h = FakeHub()
    for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_CACHE", "HF_TOKEN"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", h.url)
    monkeypatch.setenv("HF_HOME", str(home / "hf"))
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # read when huggingface_hub is first imported
    from huggingface_hub.utils import disable_progress_bars

    disable_progress_bars()  # and now, when an earlier test imported it first (no bar lines in stderr checks)
    return h
