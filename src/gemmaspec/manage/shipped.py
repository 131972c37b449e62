"""Assistants gemmaspec ships in its package (``src/gemmaspec/data/``), and the targets they belong to.

``data/assistants.json`` lists them: ``file`` (beside the JSON), ``target_size`` and ``target_sha256``
(the target file they were trained for), ``n_max`` (the draft length measured best), ``p_min`` (the
``--spec-draft-p-min`` it drafts with when none is given; absent: 0), ``default_spec`` (what
``--spec-type default`` runs for that target: ``draft-mtp``, ``ngram-simple,draft-mtp`` (n-gram lookup
first, this assistant where it finds no match) or ``ngram-simple``, whichever the speculative
benchmark measured fastest) and ``why`` (that measurement, one line).
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

SHIPPED = Path(__file__).resolve().parent.parent / "data" / "assistants.json"


def shipped_assistant_entry(target_path) -> dict | None:
    """The entry of ``data/assistants.json`` for the target at ``target_path`` (the assistant gemmaspec
    ships for it: ``file``, ``n_max``, ``default_spec``, how it was measured), or None when none is
    shipped for that file. A target is matched by file size and sha256, the sha256 read from the
    default model's check stamp when the file is the default model (so no 250 MB hash on each start).
    The answer is remembered per file (path, size, modification time): a start asks once."""
    if not SHIPPED.exists() or target_path is None:
        return None
    p = Path(target_path)
    try:
        st = p.stat()
    except OSError:
        return None
    entry = _entry_for(str(p), st.st_size, st.st_mtime_ns)
    return dict(entry) if entry is not None else None


@lru_cache(maxsize=16)
def _entry_for(path: str, size: int, mtime_ns: int) -> dict | None:
    import json

    p = Path(path)
    try:
        entries = json.loads(SHIPPED.read_text())
    except (OSError, ValueError):
        return None
    for e in entries:
        if e.get("target_size") != size:
            continue
        stamp = p.with_suffix(".verified.json")  # written by manage.default_model after its check
        sha = None
        try:
            rec = json.loads(stamp.read_text())
            if rec.get("size") == size and rec.get("mtime_ns") == mtime_ns:
                sha = rec.get("sha256")
        except (OSError, ValueError):
            pass
        if sha is None:
            import hashlib

            h = hashlib.sha256()
            with open(p, "rb") as f:
                for block in iter(lambda: f.read(1 << 24), b""):
                    h.update(block)
            sha = h.hexdigest()
        if sha == e.get("target_sha256") and (SHIPPED.parent / e["file"]).exists():
            return e | {"path": str(SHIPPED.parent / e["file"])}
    return None


def shipped_assistant(target_path) -> str | None:
    """Path of the MTP assistant shipped for the target at ``target_path``, or None."""
    e = shipped_assistant_entry(target_path)
    return e["path"] if e else None


