"""``gemmaspec quantize --exact``: exact Q4_0 files from QAT checkpoints, tensor by tensor.

Input: a :class:`~gemmaspec.quant.source.Source` (a GGUF file with BF16/F16/F32 tensors, or a Hugging
Face Gemma 4 target or assistant directory); ``general.file_type`` becomes MOSTLY_Q4_0.

Per tensor: 2-D (or higher) float weights with rows of a multiple of 32 values are packed by
:func:`gemmaspec.quant.q4_0_exact.pack_exact` a block of rows at a time; when any block fits no 4-bit
grid the tensor is written again in the fallback type (``--strict``: an error naming the tensor and
the block). Norms, scales and 1-D tensors stay F32 (as llama.cpp keeps them); already quantized and
integer tensors are copied byte for byte. Memory holds a few million values at a time
(:class:`~gemmaspec.loading.stored.StoredTensor` reads with ``pread``;
:class:`~gemmaspec.loading.gguf_out.StreamingGGUF` writes), whatever the checkpoint's size.

The :class:`~gemmaspec.quant.report.QuantizeReport` gives the evidence: per tensor, how many blocks
lie on a grid and the error against the source, beside what llama.cpp's Q8_0 and a plain amax/8 Q4_0
would give (both with ``gguf.quants``, llama.cpp's reference implementation in Python; measured on
every 16th row of large tensors unless ``compare_all``). :mod:`gemmaspec.quant.check` re-reads the
file and checks it against the source (``gemmaspec verify``).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T
from tqdm import tqdm

from ..errors import InputError
from ..loading.convert import keep_f32, stream_tensor
from ..loading.gguf_out import StreamingGGUF, encode_rows
from ..loading.stored import FLOAT_MANTISSA, StoredTensor
from .q4_0_exact import QK, pack_exact
from .report import ErrorFigures, QuantizeReport, TensorReport
from .source import COPY_BYTES, open_source, row_spans

FALLBACKS = {"q8_0": T.Q8_0, "f16": T.F16, "bf16": T.BF16, "f32": T.F32}  # --fallback choices
COMPARE_STRIDE = 16  # every 16th row of large tensors feeds the Q8_0 / amax-Q4_0 comparison


def _packable(name: str, t: StoredTensor) -> bool:
    """A float weight of 2 or more dimensions whose rows split into Q4_0 blocks, not one llama.cpp keeps F32."""
    return t.is_float and len(t.shape) >= 2 and t.row_len % QK == 0 and not keep_f32(name, t.shape)


def _compare(rows: np.ndarray, mantissa_bits: int, q8: ErrorFigures, q4: ErrorFigures) -> None:
    """Add what llama.cpp's Q8_0 and amax/8 Q4_0 (``gguf.quants``) make of ``rows`` float32 [R, K]."""
    for qtype, fig in ((T.Q8_0, q8), (T.Q4_0, q4)):
        fig.add(ErrorFigures.measure(rows, gguf.quants.dequantize(gguf.quants.quantize(rows, qtype), qtype), mantissa_bits))


def _stored_error(rows: np.ndarray, enc: np.ndarray, qtype: T, mantissa_bits: int, fig: ErrorFigures) -> None:
    """Add the error of ``rows`` float32 [R, K] as stored: ``enc``, their ``qtype`` encoding (row order)."""
    if qtype in (T.F32, T.F16):  # encode_rows gives these as float arrays
        deq = enc
    else:
        deq = gguf.quants.dequantize(enc.view(np.uint8).reshape(rows.shape[0], -1), qtype)
    fig.add(ErrorFigures.measure(rows, deq, mantissa_bits))


class OffGridError(InputError):
    """``--strict``: a block of a 2-D weight fits no 4-bit grid."""


def _pack_tensor(s: StreamingGGUF, name: str, t: StoredTensor, rep: TensorReport, fallback: T, strict: bool,
                 tolerance_ulp: float, compare_all: bool, threads: int | None) -> None:
    """Write ``t`` as exact Q4_0, or whole in ``fallback`` when a block is off the grid; fill in ``rep``.

    Raises:
        InputError: NaN or Inf in the source; (``strict``) :class:`OffGridError`.
    """
    mbits = FLOAT_MANTISSA[t.dtype]
    stride = 1 if compare_all or t.rows * t.row_len <= (1 << 20) else COMPARE_STRIDE
    compared = 0
    s.begin(name, t.shape, T.Q4_0)
    off_grid = None
    for r0, r1 in row_spans(t):
        rows = t.read_rows(r0, r1)
        if not np.isfinite(rows).all():
            bad = np.argwhere(~np.isfinite(rows))[0]
            raise InputError(f"{name}: the source holds NaN or Inf (row {r0 + bad[0]}, column {bad[1]}); "
                             "the checkpoint is damaged")
        # once a block is off the grid the tensor goes to the fallback type: the rest only feeds the report
        r = pack_exact(rows, mbits, tolerance_ulp, threads=threads, magnitudes=off_grid is None)
        rep.blocks += r.d.size
        rep.blocks_on_grid += int(r.on_grid.sum())
        rep.values += rows.size
        rep.values_exact += int(r.exact.sum())
        rep.values_exact_src += int(r.exact_src.sum())
        rep.exact.add(ErrorFigures(float(r.sq_err.sum()), float(r.sq_src.sum()), float(r.max_err_ulp.max())))
        sample = rows[(np.arange(r0, r1) % stride) == 0]
        if sample.size:
            compared += sample.shape[0]
            _compare(sample, mbits, rep.q8_0, rep.q4_0_amax)
        if off_grid is None and not r.on_grid.all():
            b = int(np.argmin(r.on_grid))
            per_row = t.row_len // QK
            off_grid = (r0 + b // per_row, b % per_row, float(r.max_err_ulp[b]))
            if strict:
                raise OffGridError(
                    f"{name}: block {off_grid[1]} of row {off_grid[0]} (values {off_grid[1] * QK}..{off_grid[1] * QK + QK - 1}) "
                    f"fits no 4-bit grid (best fit misses by {off_grid[2]:.1f} ulp); "
                    "this tensor is not QAT-trained: drop --strict to store it in the fallback type")
        if off_grid is None:
            s.write(r.q4_0_bytes())
    rep.compared_fraction = compared / t.rows
    if off_grid is None:
        rep.type = "Q4_0"
        rep.bytes = s.end()
        return
    s.discard()
    rep.type = fallback.name  # rows of a multiple of 32 (packable): Q8_0 blocks fit too
    rep.note = f"off grid at row {off_grid[0]} block {off_grid[1]}"
    s.begin(name, t.shape, fallback)
    for r0, r1 in row_spans(t):  # written again in the fallback type; its error on the compared rows
        rows = t.read_rows(r0, r1)
        enc = np.ascontiguousarray(encode_rows(rows, fallback))
        s.write(enc)
        keep = (np.arange(r0, r1) % stride) == 0
        if keep.any():
            _stored_error(rows[keep], enc[keep], fallback, mbits, rep.stored)
    rep.bytes = s.end()


def quantize_exact(src_path: str | os.PathLike, out: str | os.PathLike, fallback: str = "q8_0", strict: bool = False,
                   force: bool = False, tolerance_ulp: float = 1.0, compare_all: bool = False,
                   threads: int | None = None, progress: bool | None = None) -> QuantizeReport:
    """Write ``src_path`` as an exact-Q4_0 GGUF at ``out`` and return the report.

    Args:
        fallback: type of 2-D weights that fit no grid: ``q8_0`` (llama.cpp's choice for drafters),
            ``f16``, ``bf16`` or ``f32``.
        strict: an off-grid block in a 2-D weight is an error instead of a fallback.
        tolerance_ulp: a block is on the grid when every value is reproduced within this many units in
            the source's last place (1.0: within the source's own rounding).
        compare_all: measure the Q8_0 / amax-Q4_0 comparison on every row (slower), not every 16th.
        progress: tqdm bar over source bytes (default: when stderr is a terminal).

    Raises:
        InputError: unknown fallback, OUT exists without ``force``, NaN/Inf in the source, or (``strict``)
            an off-grid block (:class:`OffGridError`).
        ModelFileError: missing, corrupt, truncated or unsupported input.
    A failure leaves no OUT (nor partial files) behind.
    """
    if fallback not in FALLBACKS:
        raise InputError(f"--fallback must be one of {', '.join(FALLBACKS)} (got {fallback})")
    if Path(out).exists() and not force:
        raise InputError(f"{out} exists; pass --force to overwrite it")
    if Path(out).resolve() == Path(src_path).resolve():
        raise InputError("OUT is the input file; write to another path")
    t0 = time.perf_counter()
    src = open_source(src_path)
    rep = QuantizeReport(str(src_path), str(out), fallback, tolerance_ulp, source_bytes=src.nbytes, notes=list(src.notes))
    total = sum(t.nbytes for _, t in src.tensors)
    show = sys.stderr.isatty() if progress is None else progress
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="quantize", disable=not show, file=sys.stderr)
    with StreamingGGUF(out, src.arch, force, alignment=src.alignment) as s:
        for name, t in src.tensors:
            if not isinstance(t, StoredTensor):  # small computed tensor (rope_freqs): F32
                rep.tensors.append(TensorReport(name, list(t.shape), "F32", "F32", note="computed"))
                s.begin(name, t.shape, T.F32)
                s.write(t.astype(np.float32))
                rep.tensors[-1].bytes = s.end()
                bar.update(t.nbytes)
                continue
            tr = TensorReport(name, list(t.shape), t.dtype, t.dtype)
            rep.tensors.append(tr)
            if _packable(name, t):
                _pack_tensor(s, name, t, tr, FALLBACKS[fallback], strict, tolerance_ulp, compare_all, threads)
            elif t.is_float:
                tr.type, tr.note = "F32", "kept F32"
                tr.bytes = stream_tensor(s, name, t, T.F32)
            elif src.path.is_file():  # already quantized or integer GGUF tensor: copied as is
                tr.note = "copied"
                s.begin(name, t.shape, T[t.dtype])
                for start in range(0, t.nbytes, COPY_BYTES):
                    s.write(t.read_bytes(start, min(COPY_BYTES, t.nbytes - start)))
                tr.bytes = s.end()
            else:  # integer safetensors tensor (token ordering)
                tr.type, tr.note = "I32", "kept"
                tr.bytes = stream_tensor(s, name, t, T.I32)
            bar.update(t.nbytes)
        bar.close()
        rep.output_bytes = s.finish(lambda w: src.add_metadata(w, gguf.LlamaFileType.MOSTLY_Q4_0))
    rep.seconds = time.perf_counter() - t0
    return rep
