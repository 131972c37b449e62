"""A catalog model's metadata from the hub without its weights, for ``gemmaspec fit -m NAME`` and
``gemmaspec export … -m NAME`` before a multi-GB download.

What is read, by HTTP ``Range`` through huggingface_hub's file URL (``hf_hub_url``, its session and
headers, ``HF_ENDPOINT``/``HF_TOKEN``), each request under :func:`gemmaspec.manage.hub.short_retries`:

- a **GGUF** entry: the first 8 MiB of the file (doubled until the header and tensor table are read
  whole), the file's size from ``Content-Range``;
- a **checkpoint directory**: ``config.json`` (and ``model.safetensors.index.json`` when the repo has
  one), then per safetensors shard its 8-byte length and JSON header.

The bytes are laid into a stand-in of the same shape in a temporary directory (removed at exit):
each file holds the bytes read and is extended to its full size as a sparse file (no disk used), so
:func:`gemmaspec.manage.fit.read_model` reads it exactly as a downloaded copy; tensor data is never
fetched. Nothing goes into the hub cache, so the name still counts as not downloaded.
"""

from __future__ import annotations

import atexit
import json
import shutil
import tempfile
from pathlib import Path

from ..errors import ModelFileError
from . import catalog, hub
from .catalog import Entry

GGUF_FIRST_READ = 8 << 20
_root: Path | None = None


def _tmp() -> Path:
    global _root
    if _root is None or not _root.is_dir():
        _root = Path(tempfile.mkdtemp(prefix="gemmaspec-meta-"))
        atexit.register(shutil.rmtree, _root, True)
    return _root


def _get(repo: str, filename: str, start: int, end: int | None, s) -> tuple[bytes, int | None]:
    """Bytes ``start..end`` (inclusive; None: to the end) of ``repo:filename`` and the file's total size."""
    from huggingface_hub import hf_hub_url
    from huggingface_hub.utils import build_hf_headers, hf_raise_for_status, http_backoff

    url = hf_hub_url(repo, filename, endpoint=s.endpoint)
    headers = build_hf_headers(token=s.token)
    headers["Range"] = f"bytes={start}-{'' if end is None else end}"

    def call():
        r = http_backoff("GET", url, headers=headers, follow_redirects=True)
        hf_raise_for_status(r)
        return r

    r = hub._hub_call(call, f"{repo}:{filename}", s)
    total = None
    cr = r.headers.get("Content-Range", "")
    if "/" in cr and cr.rsplit("/", 1)[1].isdigit():
        total = int(cr.rsplit("/", 1)[1])
    elif r.status_code == 200:  # the server ignored Range: the whole file came
        total = len(r.content)
        data = r.content[start:] if end is None else r.content[start:end + 1]
        return data, total
    return r.content, total


def _lay(path: Path, data: bytes, size: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
        f.truncate(max(size, len(data)))  # sparse: the rest reads as zeros and takes no disk


def _gguf(repo: str, filename: str, s) -> Path:
    from ..loading.gguf_header import read_header

    path = _tmp() / repo.replace("/", "--") / Path(filename).name
    n = GGUF_FIRST_READ
    while True:
        data, total = _get(repo, filename, 0, n - 1, s)
        total = total or len(data)
        _lay(path, data, total)
        try:
            header = read_header(path)
            if header.data_offset <= len(data):  # the header and tensor table came from real bytes
                return path
        except ModelFileError:
            if len(data) >= total:
                raise
        if len(data) >= total:
            return path
        n *= 2


def _directory(repo: str, s) -> Path:
    root = _tmp() / repo.replace("/", "--")
    root.mkdir(parents=True, exist_ok=True)
    cfg, _ = _get(repo, "config.json", 0, None, s)
    (root / "config.json").write_bytes(cfg)
    try:
        index, _ = _get(repo, "model.safetensors.index.json", 0, None, s)
        (root / "model.safetensors.index.json").write_bytes(index)
        shards = sorted(set(json.loads(index)["weight_map"].values()))
    except ModelFileError as exc:
        if "no such file" not in str(exc):
            raise
        shards = ["model.safetensors"]
    except (ValueError, KeyError) as exc:
        raise ModelFileError(f"{repo}: model.safetensors.index.json is not a valid index ({exc})") from None
    for shard in shards:
        head, total = _get(repo, shard, 0, 7, s)
        n = int.from_bytes(head[:8], "little")
        if len(head) < 8 or n <= 0 or n > 100 << 20:
            raise ModelFileError(f"{repo}:{shard} is not a safetensors file")
        body, _ = _get(repo, shard, 8, 8 + n - 1, s)
        _lay(root / shard, head[:8] + body, total or 8 + n)
    return root


def metadata_path(entry: Entry) -> Path:
    """A stand-in of ``entry``'s checkpoint holding its real metadata and no weights (see the module
    docstring); offline (``HF_HUB_OFFLINE``) it is refused.

    Raises:
        ModelFileError: offline, the hub unreachable (one line), the file or repository missing.
    """
    s = hub.settings()
    if s.offline:
        raise ModelFileError(f"{entry.name} is not downloaded and HF_HUB_OFFLINE is set: its metadata cannot be "
                             f"read from the hub (gemmaspec pull {entry.name} first)")
    if entry.is_dir:
        return _directory(entry.repo, s)
    return _gguf(entry.repo, hub._pick_file(entry, None, s), s)


def resolve(arg: str | None, metadata: bool = True) -> tuple[str | None, Entry | None]:
    """:func:`gemmaspec.manage.hub.resolve`, except that (with ``metadata``) a catalog name that is not
    downloaded becomes its metadata-only stand-in (:func:`metadata_path`) instead of an error.

    Raises:
        InputError / ModelFileError: as those.
    """
    entry = catalog.find(arg) if arg else None
    if (metadata and entry is not None and entry.repo and not entry.placeholder
            and not Path(arg).expanduser().exists() and hub.cached_path(entry) is None):
        return str(metadata_path(entry)), entry
    return hub.resolve(arg)


def is_stand_in(path) -> bool:
    """Whether ``path`` is a metadata-only stand-in made here (no weights behind it)."""
    return _root is not None and path is not None and Path(path).is_relative_to(_root)
