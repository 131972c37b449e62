"""Downloads from the Hugging Face Hub (``gemmaspec pull``) and catalog names on the command line.

Everything goes through ``huggingface_hub`` and its cache (``HF_HOME``/``HF_HUB_CACHE``), so a file
pulled here is the same file other tools see. The environment is read when a function is called
(``HF_ENDPOINT``, ``HF_HOME``, ``HF_HUB_CACHE``, ``HF_TOKEN``, ``HF_HUB_OFFLINE``), not when the
module is imported. ``huggingface_hub`` shows the progress bar and resumes a transfer that breaks off
(an HTTP ``Range`` request from the bytes it has). After every download the file's sha256 is checked
against, in this order, ``--sha256``, the catalog's hash for that entry (or for that file name) and
the hub's own LFS hash (its ETag); a mismatch deletes the download and names the file and both hashes.
"""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import InputError, ModelFileError
from . import catalog
from .catalog import Entry

log = logging.getLogger(__name__)

DEFAULT_ENDPOINT = "https://huggingface.co"
DIR_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]
"""What a checkpoint-directory pull fetches (config, weights, tokenizer, chat template; no vision
or audio extras beyond what the safetensors hold, no README images)."""
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
HUB_RETRIES = 2
"""Retries of one hub request after a network error or a 5xx (huggingface_hub's default is 5, with
waits of 1, 2, 4, 8, 8 s: 23 s before a machine without network hears anything)."""
HUB_RETRY_WAIT = 0.5
"""Seconds before the first retry (doubled for the next, at most 1 s)."""
_NETWORK_MODULES = ("httpx", "httpx2", "httpcore", "requests", "urllib3", "ssl", "socket")


@dataclass(frozen=True)
class HubSettings:
    """The hub settings of the environment at call time."""

    endpoint: str
    cache_dir: Path
    token: str | None
    offline: bool


def settings() -> HubSettings:
    """``HF_ENDPOINT`` (default huggingface.co), the hub cache (``HF_HUB_CACHE``, else
    ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``), ``HF_TOKEN``, ``HF_HUB_OFFLINE``."""
    env = os.environ
    home = Path(env.get("HF_HOME") or Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "huggingface")
    cache = Path(env.get("HF_HUB_CACHE") or home / "hub").expanduser()
    offline = (env.get("HF_HUB_OFFLINE") or env.get("TRANSFORMERS_OFFLINE") or "").strip().upper() in (
        "1", "ON", "YES", "TRUE")
    return HubSettings((env.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/"), cache, env.get("HF_TOKEN") or None,
                       offline)


def _repo_dir(s: HubSettings, repo: str) -> Path:
    return s.cache_dir / f"models--{repo.replace('/', '--')}"


def cached_snapshot(repo: str, revision: str | None = None, s: HubSettings | None = None) -> Path | None:
    """The cached snapshot directory of ``repo`` at ``revision`` (a branch, tag or commit; default
    main), or None when nothing of it is cached."""
    s = s or settings()
    root = _repo_dir(s, repo)
    rev = revision or "main"
    ref = root / "refs" / rev
    commit = ref.read_text().strip() if ref.is_file() else rev
    snap = root / "snapshots" / commit
    return snap if snap.is_dir() else None


def cached_path(entry: Entry, revision: str | None = None, s: HubSettings | None = None) -> Path | None:
    """Where a catalog entry lies in the cache (its file, or its snapshot directory when that holds a
    config.json), or None when it is not cached. The default model: its assembled file."""
    if entry.package == "gemmaspec":  # shipped inside this package (src/gemmaspec/data/)
        from .shipped import SHIPPED

        p = SHIPPED.parent / entry.file
        return p if p.exists() else None
    if entry.package:
        from .default_model import default_model_path

        return default_model_path()
    if entry.placeholder or not entry.repo:
        return None
    snap = cached_snapshot(entry.repo, revision, s)
    if snap is None:
        return None
    if entry.is_dir:
        return snap if (snap / "config.json").is_file() else None
    if entry.file:
        p = snap / entry.file
        return p if p.is_file() else None
    found = sorted(p for p in snap.rglob(entry.file_glob) if p.is_file() and not (
        entry.exclude_glob and fnmatch.fnmatch(p.name, entry.exclude_glob)))
    return found[0] if found else None


def cached_repos(s: HubSettings | None = None) -> list[str]:
    """``repo (files)`` for every model repo in the hub cache (what offline mode can use)."""
    s = s or settings()
    out = []
    if not s.cache_dir.is_dir():
        return out
    for d in sorted(s.cache_dir.glob("models--*")):
        files = sorted({str(p.relative_to(snap)) for snap in (d / "snapshots").glob("*") for p in snap.rglob("*")
                        if p.is_file()})
        if files:
            out.append(f"{d.name[len('models--'):].replace('--', '/')} ({', '.join(files[:6])}"
                       f"{', ...' if len(files) > 6 else ''})")
    return out


def file_sha256(path: Path, chunk: int = 1 << 22) -> str:
    """Hex sha256 of a file, read in 4 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _offline_error(what: str, s: HubSettings) -> ModelFileError:
    cached = cached_repos(s)
    listing = "; cached: " + "; ".join(cached) if cached else f"; nothing is cached in {s.cache_dir}"
    return ModelFileError(f"offline (HF_HUB_OFFLINE is set) and {what} is not in the cache{listing}")


@contextlib.contextmanager
def short_retries():
    """huggingface_hub's request retries cut to :data:`HUB_RETRIES` (waits from
    :data:`HUB_RETRY_WAIT`) while the block runs, and its retry warnings kept off stderr (the one
    error line says what failed): the keyword defaults of ``http_backoff`` / ``http_stream_backoff``
    (every hub request of the library) and of ``http_get`` (a download that breaks off before any byte
    arrives; one that got bytes still resumes as before), set and then put back."""
    from huggingface_hub import file_download
    from huggingface_hub.utils import _http

    settings_ = ((getattr(_http, "http_backoff", None), {"max_retries": HUB_RETRIES, "base_wait_time": HUB_RETRY_WAIT,
                                                         "max_wait_time": 1.0}),
                 (getattr(_http, "http_stream_backoff", None), {"max_retries": HUB_RETRIES,
                                                                "base_wait_time": HUB_RETRY_WAIT, "max_wait_time": 1.0}),
                 (getattr(file_download, "http_get", None), {"_nb_retries": HUB_RETRIES}))
    saved = []
    for f, new in settings_:
        kw = getattr(f, "__kwdefaults__", None)
        if isinstance(kw, dict):
            saved.append((kw, {k: kw[k] for k in new if k in kw}))
            kw.update({k: v for k, v in new.items() if k in kw})
    loggers = [logging.getLogger(m.__name__) for m in (_http, file_download)]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for kw, old in saved:
            kw.update(old)
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _is_network_error(exc: BaseException) -> bool:
    """A transport failure (refused, reset, timed out, DNS, TLS) of the HTTP client huggingface_hub uses."""
    return any(c.__module__.split(".")[0] in _NETWORK_MODULES for c in type(exc).__mro__[:-2])


def _hub_call(fn, what: str, s: HubSettings):
    """Run a huggingface_hub call with a short retry budget (:func:`short_retries`), turning its errors,
    network failures included, into one-line gemmaspec errors."""
    from huggingface_hub import errors as hfe

    try:
        with short_retries():
            return fn()
    except hfe.GatedRepoError:
        raise ModelFileError(f"{what} is gated: accept its license on the hub and set HF_TOKEN") from None
    except hfe.RepositoryNotFoundError:
        raise ModelFileError(f"{what}: no such repository on {s.endpoint} (or it is private: set HF_TOKEN)") from None
    except hfe.RevisionNotFoundError:
        raise ModelFileError(f"{what}: no such revision on {s.endpoint}") from None
    except hfe.LocalEntryNotFoundError as exc:
        if s.offline:
            raise _offline_error(what, s) from None
        cause = exc.__cause__ or exc.__context__
        if cause is not None and _is_network_error(cause):
            raise _network_error(what, cause, s, cached=False) from None
        raise ModelFileError(f"cannot download {what} from {s.endpoint} and it is not cached ({exc}); "
                             "check the network or HF_ENDPOINT") from None
    except hfe.EntryNotFoundError:
        raise ModelFileError(f"{what}: no such file in the repository on {s.endpoint}") from None
    except hfe.HfHubHTTPError as exc:
        raise ModelFileError(f"{what}: the hub at {s.endpoint} answered {exc}") from None
    except OSError as exc:
        if _is_network_error(exc):
            raise _network_error(what, exc, s) from None
        raise ModelFileError(f"{what}: download failed ({exc})") from None
    except Exception as exc:
        if _is_network_error(exc):
            raise _network_error(what, exc, s) from None
        raise


def _network_error(what: str, exc: BaseException, s: HubSettings, cached: bool | None = None) -> ModelFileError:
    detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return ModelFileError(f"{what}: cannot reach the hub at {s.endpoint} ({detail}; gave up after {HUB_RETRIES} "
                          f"retries){' and it is not cached' if cached is False else ''}; check the network or HF_ENDPOINT, or set HF_HUB_OFFLINE=1 to use the cache only")


def _remove_download(path: Path) -> None:
    """Delete a downloaded file from the hub cache: the snapshot link and the blob it points to."""
    import shutil

    real = path.resolve()
    path.unlink(missing_ok=True)
    if real != path:
        real.unlink(missing_ok=True)
    repo = next((p for p in path.parents if p.name.startswith("models--")), None)
    if repo is not None and not any(p.is_file() for p in (repo / "snapshots").rglob("*")):
        shutil.rmtree(repo, ignore_errors=True)  # nothing else of this repo is cached: no refs left behind


def _check(path: Path, label: str, expected: list[tuple[str, str]]) -> str:
    """Check ``path``'s sha256 against each ``(hash, where it came from)``; on a mismatch delete it.

    Raises:
        ModelFileError: naming the file, the expected hash (and its origin) and the actual one.
    """
    actual = file_sha256(path)
    for want, origin in expected:
        if actual != want.lower():
            _remove_download(path)
            raise ModelFileError(f"sha256 mismatch for {label}: expected {want.lower()} ({origin}), got {actual}; "
                                 "the download was deleted")
    return actual


@dataclass(frozen=True)
class Pulled:
    """One pulled file or directory: ``label`` (repo:file or catalog name), local ``path``,
    ``sha256`` (None for a directory; its files are each checked against the hub's hashes)."""

    label: str
    path: Path
    sha256: str | None


def _download_file(repo: str, filename: str, revision: str | None, expected: list[tuple[str, str]],
                   s: HubSettings) -> Pulled:
    from huggingface_hub import get_hf_file_metadata, hf_hub_download, hf_hub_url

    label = f"{repo}:{filename}"
    path = Path(_hub_call(lambda: hf_hub_download(repo, filename, revision=revision, cache_dir=s.cache_dir,
                                                  endpoint=s.endpoint, token=s.token, local_files_only=s.offline),
                          label, s))
    expected = list(expected)
    if not s.offline:  # the hub's LFS hash (its ETag), when the hub gave one
        try:
            with short_retries():
                meta = get_hf_file_metadata(hf_hub_url(repo, filename, revision=revision, endpoint=s.endpoint),
                                            token=s.token, endpoint=s.endpoint)
            if meta.etag and _SHA256.match(meta.etag.lower()):
                expected.append((meta.etag, f"the hub's LFS hash from {s.endpoint}"))
        except Exception:  # noqa: BLE001 - the file is there; the extra check is best effort
            pass
    return Pulled(label, path, _check(path, label, expected))


def _pick_file(entry: Entry, revision: str | None, s: HubSettings) -> str:
    """The file of a ``file_glob`` entry, from the repository's listing."""
    if entry.file:
        return entry.file
    cached = cached_path(entry, revision, s)
    if s.offline:
        if cached is None:
            raise _offline_error(entry.name, s)
        return cached.name
    from huggingface_hub import HfApi

    files = _hub_call(lambda: list(HfApi(endpoint=s.endpoint, token=s.token).list_repo_files(entry.repo,
                                                                                             revision=revision)),
                      entry.repo, s)
    found = sorted(f for f in files if fnmatch.fnmatch(f, entry.file_glob)
                   and not (entry.exclude_glob and fnmatch.fnmatch(Path(f).name, entry.exclude_glob)))
    if not found:
        raise ModelFileError(f"{entry.repo} has no file matching {entry.file_glob} (files: {', '.join(files[:10])})")
    if len(found) > 1:
        raise InputError(f"{entry.repo} has several files matching {entry.file_glob}: {', '.join(found)}; "
                         f"pull one as {entry.repo}:FILE")
    return found[0]


def _pull_entry(entry: Entry, revision: str | None, sha256: str | None, s: HubSettings) -> Pulled:
    if entry.placeholder:
        raise InputError(f"{entry.name} is listed but not available: {entry.note}")
    if entry.package == "gemmaspec":
        path = cached_path(entry)
        if path is None:
            raise InputError(f"{entry.name} ships inside gemmaspec but {entry.file} is missing from this installation")
        return Pulled(entry.name, path, None)
    if entry.package:
        from .default_model import default_model_path

        return Pulled(entry.name, default_model_path(), None)
    if not entry.repo:
        raise InputError(f"the catalog does not record where {entry.name} is hosted: pull it as REPO:{entry.file} "
                         f"(its catalog sha256 {entry.sha256} is checked whatever the repository)")
    if entry.is_dir:
        return _download_dir(entry.repo, revision, s, label=entry.name)
    expected = [(sha256, "--sha256")] if sha256 else []
    if entry.sha256:
        expected.append((entry.sha256, f"the catalog entry {entry.name}"))
    return _download_file(entry.repo, _pick_file(entry, revision, s), revision, expected, s)


def _download_dir(repo: str, revision: str | None, s: HubSettings, label: str) -> Pulled:
    from huggingface_hub import snapshot_download

    path = Path(_hub_call(lambda: snapshot_download(repo, revision=revision, cache_dir=s.cache_dir,
                                                    endpoint=s.endpoint, token=s.token, local_files_only=s.offline,
                                                    allow_patterns=DIR_PATTERNS), label, s))
    if not s.offline:
        _check_dir(repo, revision, path, s)
    return Pulled(label, path, None)


def _check_dir(repo: str, revision: str | None, path: Path, s: HubSettings) -> None:
    """Check every LFS file of a pulled directory against the hub's sha256 (its listing's ``lfs``)."""
    from huggingface_hub import HfApi

    info = _hub_call(lambda: HfApi(endpoint=s.endpoint, token=s.token).model_info(repo, revision=revision,
                                                                                  files_metadata=True), repo, s)
    for sib in info.siblings or []:
        lfs = getattr(sib, "lfs", None)
        sha = getattr(lfs, "sha256", None) if lfs is not None else None
        p = path / sib.rfilename
        if sha and p.is_file():
            _check(p, f"{repo}:{sib.rfilename}", [(sha, f"the hub's LFS hash from {s.endpoint}")])


def parse_spec(spec: str) -> tuple[Entry | None, str | None, str | None]:
    """``NAME`` → (entry, None, None); ``REPO[:FILE]`` → (None, repo, file or None).

    Raises:
        InputError: neither a catalog name nor ``owner/name[:file]`` (close matches listed).
    """
    entry = catalog.find(spec)
    if entry is not None:
        return entry, None, None
    repo, _, file = spec.partition(":")
    if re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", repo):
        return None, repo, file or None
    catalog.get(spec)  # raises with the close matches
    raise AssertionError  # pragma: no cover


def pull(spec: str, revision: str | None = None, sha256: str | None = None,
         with_assistant: bool = False) -> list[Pulled]:
    """Download ``spec`` (a catalog name, ``REPO`` or ``REPO:FILE``) into the hub cache and check it.

    Args:
        revision: branch, tag or commit (default main); pinning a commit makes the download repeatable.
        sha256: expected hash of the file (refused for a directory).
        with_assistant: also fetch the catalog's assistant for this target (a QAT target gets its
            QAT assistant).

    Returns:
        The pulled target (and assistant), each with its path.

    Raises:
        InputError: unknown name (with close matches), a placeholder, a bad hash string.
        ModelFileError: a hash mismatch (the download is deleted), offline with nothing cached
            (the cache is listed), the hub refused or could not be reached.
    """
    s = settings()
    if sha256 is not None and not _SHA256.match(sha256.lower()):
        raise InputError(f"--sha256 must be 64 hex digits (got {sha256!r})")
    entry, repo, file = parse_spec(spec)
    out = []
    if entry is not None:
        out.append(_pull_entry(entry, revision, sha256, s))
    elif file:
        expected = [(sha256, "--sha256")] if sha256 else []
        known = catalog.by_file(file)
        if known is not None:
            expected.append((known.sha256, f"the catalog entry {known.name}"))
            entry = known
        out.append(_download_file(repo, file, revision, expected, s))
    else:
        if sha256:
            raise InputError("--sha256 checks one file: pull REPO:FILE")
        out.append(_download_dir(repo, revision, s, label=repo))
    if with_assistant:
        if entry is None or entry.role != "target":
            raise InputError(f"--with-assistant needs a catalog target name (got {spec}); gemmaspec models lists them")
        partner = catalog.pair(entry)
        if partner is None or partner.placeholder:
            raise InputError(f"{entry.name} has no assistant available"
                             + (f": {partner.note}" if partner is not None else ""))
        if not partner.repo and partner.hf_equivalent:
            log.info("note: %s has no recorded repository; pulling %s (the same assistant as a checkpoint "
                     "directory) instead", partner.name, partner.hf_equivalent)
            partner = catalog.get(partner.hf_equivalent)
        out.append(_pull_entry(partner, None, None, s))
    return out


def resolve(arg: str | None) -> tuple[str | None, Entry | None]:
    """What ``-m``/``-md`` ARG means: ``(path, catalog entry or None)``. An existing path stays as
    it is; a catalog name becomes its cached file or directory; None stays None (the default model).
    (:func:`gemmaspec.manage.remote.resolve` turns a name not downloaded into its metadata instead.)

    Raises:
        InputError: a catalog name that is not downloaded (says which ``gemmaspec pull`` to run), a
            placeholder, or a name that is neither a file nor in the catalog (close matches listed).
    """
    if arg is None:
        return None, catalog.find("gemma-3-270m")
    p = Path(arg).expanduser()
    if p.exists():
        return str(p), catalog.by_file(p.name) or next((e for e in catalog.entries() if e.file == p.name), None)
    entry = catalog.find(arg)
    if entry is None:
        repo = arg if re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", arg) else None
        snap = cached_snapshot(repo) if repo else None
        if snap is not None and (snap / "config.json").is_file():
            return str(snap), None
        if "/" in arg or os.sep in arg or arg.endswith((".gguf", ".safetensors")):
            return arg, None  # a path: the loader says it is missing
        catalog.get(arg)  # raises with the close matches
    if entry.placeholder:
        raise InputError(f"{entry.name} is listed but not available: {entry.note}")
    path = cached_path(entry)
    if path is None:
        raise InputError(f"{entry.name} is not downloaded: run `gemmaspec pull {entry.name}` first")
    return str(path), entry
