"""llama-server's slot save / restore / erase (``POST /slots/{id}?action=...`` with ``--slot-save-path``).

A slot's prompt cache (the tokens it holds and their keys and values, see
:class:`~gemmaspec.server.scheduler.Slot`) is written to a file in the save directory and read back
into a slot later, so a long shared prefix (a system prompt, a document) is computed once and survives
restarts; the next request whose prompt starts with those tokens reuses them (``timings.cache_n``).
The functions here run on the scheduler thread (:meth:`~gemmaspec.server.scheduler.Scheduler.slot_action`),
when the slot is free.

The file is ``torch.save`` of a dict (loaded back with ``weights_only=True``: tensors and plain
values only): ``format``, ``model`` (the file name it was computed with), ``capacity``, ``tokens``,
``length``, ring-buffer bookkeeping, and per layer ``(k, v)`` (full-attention layers: the first
``length`` rows; sliding-window rings: every row) or None. Responses are llama-server's:
``{"id_slot", "filename", "n_saved", "n_written", "timings": {"save_ms"}}``,
``{"id_slot", "filename", "n_restored", "n_read", "timings": {"restore_ms"}}``, ``{"id_slot", "n_erased"}``.

Files never leave the directory (the kind of llama.cpp #26315): names are plain names
(:func:`check_filename`), and every file is opened relative to the open directory without following
links (:class:`SlotDir`: ``dir_fd`` and ``O_NOFOLLOW``). A save writes a temporary file created
exclusively under a random name and renames it over the slot's name within the directory (a rename
replaces a link, it never writes through one); a symbolic link, a directory or any other non-regular
file at the slot's name is refused on save and restore, with the name in the message.
"""

from __future__ import annotations

import errno
import os
import re
import secrets
import stat
import time
from pathlib import Path

import torch

from ..errors import InputError

FORMAT = "gemmaspec-slot-1"


def check_filename(name) -> str:
    """A file name for the save directory: no directories, no leading dot, at most 255 bytes.

    Raises:
        InputError: anything else (so a request cannot reach outside ``--slot-save-path``).
    """
    if not isinstance(name, str) or not name:
        raise InputError("'filename' is required: the name of the file in --slot-save-path")
    if (len(name.encode()) > 255 or name.startswith(".") or not re.fullmatch(r"[^/\\\x00-\x1f:*?\"<>|]+", name)):
        raise InputError(f"invalid 'filename' {name!r}: a plain file name (no directories, no leading dot, "
                         "no control or reserved characters)")
    return name


_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_DIR_FD = os.open in os.supports_dir_fd and os.rename in os.supports_dir_fd and bool(_NOFOLLOW)


class SlotDir:
    """``--slot-save-path``, opened once per action; file names are checked and resolved in it only.

    Where the platform has ``dir_fd`` and ``O_NOFOLLOW`` (Linux, macOS) files are opened relative to the
    directory's descriptor; elsewhere each name is checked with ``lstat`` right before use.

    Raises:
        InputError: the directory is missing or not a directory.
    """

    def __init__(self, directory):
        self.path = Path(directory)
        self.fd = None
        if _DIR_FD:
            try:
                self.fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _CLOEXEC)
            except OSError as exc:
                raise InputError(f"--slot-save-path {self.path}: {exc.strerror or exc}") from None
        elif not self.path.is_dir():
            raise InputError(f"--slot-save-path {self.path}: not a directory")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def lstat(self, name: str):
        """The entry ``name`` itself (a link is not followed), or None when there is none."""
        try:
            if self.fd is not None:
                return os.stat(name, dir_fd=self.fd, follow_symlinks=False)
            return os.lstat(self.path / name)
        except FileNotFoundError:
            return None

    def check_regular(self, name: str, st) -> None:
        """Refuse anything at ``name`` but a regular file (a link may point outside the directory)."""
        if stat.S_ISLNK(st.st_mode):
            raise InputError(f"{name!r} in --slot-save-path is a symbolic link: slot files must be regular "
                             "files in the directory (links are not followed)")
        if not stat.S_ISREG(st.st_mode):
            raise InputError(f"{name!r} in --slot-save-path is not a regular file")

    def open_read(self, name: str):
        """``name`` opened for reading (a binary file object), never through a link.

        Raises:
            InputError: no such file, a link, or not a regular file.
        """
        try:
            if self.fd is not None:
                fd = os.open(name, os.O_RDONLY | _NOFOLLOW | _CLOEXEC | _NONBLOCK, dir_fd=self.fd)
            else:
                st = self.lstat(name)
                if st is not None:
                    self.check_regular(name, st)
                fd = os.open(self.path / name, os.O_RDONLY | _CLOEXEC | getattr(os, "O_BINARY", 0))
        except FileNotFoundError:
            raise InputError(f"no saved slot named {name!r} in --slot-save-path") from None
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.EMLINK):  # O_NOFOLLOW on a link (EMLINK: FreeBSD)
                raise InputError(f"{name!r} in --slot-save-path is a symbolic link: slot files must be regular "
                                 "files in the directory (links are not followed)") from None
            raise InputError(f"cannot read {name!r} in --slot-save-path ({exc.strerror or exc})") from None
        try:
            self.check_regular(name, os.fstat(fd))
            if _NONBLOCK:
                os.set_blocking(fd, True)
        except BaseException:
            os.close(fd)
            raise
        return os.fdopen(fd, "rb")

    def write_atomic(self, name: str, write) -> int:
        """Call ``write(file)`` on a new temporary file in the directory, then rename it to ``name``.

        The temporary file is created exclusively (``O_CREAT | O_EXCL``, no link followed) under a
        random name that :func:`check_filename` refuses (a leading dot), so no request can plant or name
        it. Returns the bytes written.

        Raises:
            InputError: something other than a regular file is at ``name``, or the file cannot be written.
        """
        st = self.lstat(name)
        if st is not None:
            self.check_regular(name, st)
        tmp = f".slot-{secrets.token_hex(12)}.tmp"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC | getattr(os, "O_BINARY", 0)
        try:
            fd = os.open(tmp, flags, 0o644, dir_fd=self.fd) if self.fd is not None else os.open(self.path / tmp, flags, 0o644)
        except OSError as exc:
            raise InputError(f"cannot save {name!r} in --slot-save-path ({exc.strerror or exc})") from None
        try:
            with os.fdopen(fd, "wb") as f:
                write(f)
                f.flush()
                os.fsync(f.fileno())
                size = os.fstat(f.fileno()).st_size
            if self.fd is not None:
                os.rename(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)  # replaces a link, never follows it
            else:
                os.replace(self.path / tmp, self.path / name)
        except BaseException as exc:
            try:
                os.unlink(tmp, dir_fd=self.fd) if self.fd is not None else os.unlink(self.path / tmp)
            except OSError:
                pass
            if isinstance(exc, OSError):
                raise InputError(f"cannot save {name!r} in --slot-save-path ({exc.strerror or exc})") from None
            raise
        return size


def save(slot, directory, filename: str, model: str) -> dict:
    """Write ``slot``'s cached tokens and their K/V to ``filename`` in ``directory``; llama-server's
    response fields.

    Raises:
        InputError: a bad name, or a link or other non-regular file at that name.
    """
    t0 = time.perf_counter()
    name = check_filename(filename)
    cache, n = slot.cache, len(slot.cached)
    layers = []
    for lay in cache.layers:
        if lay is None:
            layers.append(None)
        elif lay.window is not None:  # a ring: positions live modulo its rows
            layers.append((lay.k.clone(), lay.v.clone()))
        else:
            layers.append((lay.k[:n].clone(), lay.v[:n].clone()))
    state = {"format": FORMAT, "model": model, "capacity": cache.capacity, "tokens": list(slot.cached),
             "length": n, "ring_rows": cache.ring_rows or 0, "slot_pos": cache.slot_pos.clone(), "layers": layers}
    with SlotDir(directory) as d:
        size = d.write_atomic(name, lambda f: torch.save(state, f))
    return {"id_slot": slot.index, "filename": name, "n_saved": n, "n_written": size,
            "timings": {"save_ms": (time.perf_counter() - t0) * 1e3}}


def restore(slot, directory, filename: str, model: str) -> dict:
    """Read ``filename`` in ``directory`` into ``slot`` (its tokens become the slot's prompt cache).

    Raises:
        InputError: a bad name, no such file, a link or other non-regular file, not a slot file, or one
            saved from another model or cache shape.
    """
    t0 = time.perf_counter()
    name = check_filename(filename)
    with SlotDir(directory) as d, d.open_read(name) as f:
        size = os.fstat(f.fileno()).st_size
        try:
            state = torch.load(f, map_location=slot.cache.device, weights_only=True)
        except Exception as exc:  # noqa: BLE001 - any unreadable file is the user's
            raise InputError(f"{name!r} is not a saved slot ({type(exc).__name__}: {exc})") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise InputError(f"{name!r} is not a gemmaspec slot file")
    if state["model"] != model:
        raise InputError(f"{name!r} was saved with model {state['model']}, this server runs {model}")
    cache, n = slot.cache, state["length"]
    shapes_ok = (len(state["layers"]) == len(cache.layers) and n <= cache.capacity and n == len(state["tokens"])
                 and state["ring_rows"] == (cache.ring_rows or 0))
    for lay, saved in zip(cache.layers, state["layers"]) if shapes_ok else ():
        if (lay is None) != (saved is None) or lay is not None and (
                saved[0].shape[1:] != lay.k.shape[1:] or saved[0].shape[0] != (lay.rows if lay.window is not None else n)):
            shapes_ok = False
    if not shapes_ok:
        raise InputError(f"{name!r} was saved with another context size or cache layout")
    for lay, saved in zip(cache.layers, state["layers"]):
        if lay is not None:
            lay.k[:saved[0].shape[0]].copy_(saved[0])
            lay.v[:saved[1].shape[0]].copy_(saved[1])
    cache.reset()
    cache.length = cache._high = n
    if cache.ring_rows:
        cache.slot_pos.copy_(state["slot_pos"])
    slot.cached = list(state["tokens"])
    return {"id_slot": slot.index, "filename": name, "n_restored": n, "n_read": size,
            "timings": {"restore_ms": (time.perf_counter() - t0) * 1e3}}


def erase(slot) -> dict:
    """Forget ``slot``'s prompt cache."""
    n = len(slot.cached)
    slot.cached = []
    slot.cache.reset()
    return {"id_slot": slot.index, "n_erased": n}
