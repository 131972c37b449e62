"""``gemmaspec quantize --exact`` and ``gemmaspec verify``: exact Q4_0 files from QAT checkpoints, with proof.

Input: a GGUF file with BF16/F16/F32 tensors (any architecture: metadata and tensor names are kept;
``general.file_type`` becomes MOSTLY_Q4_0), or a Hugging Face Gemma 4 target or assistant directory
(written in llama.cpp's naming and metadata by :func:`gemmaspec.loading.gemma4_gguf.hf_source`,
tokenizer and the assistant's clustered-head tensors included).

Per tensor: 2-D (or higher) float weights with rows of a multiple of 32 values are packed by
:func:`gemmaspec.quant.q4_0_exact.pack_exact` a block of rows at a time; when any block fits no 4-bit
grid the tensor is written again in the fallback type (``--strict``: an error naming the tensor and
the block). Norms, scales and 1-D tensors stay F32 (as llama.cpp keeps them); already quantized and
integer tensors are copied byte for byte. Memory holds a few million values at a time
(:class:`~gemmaspec.loading.stored.StoredTensor` reads with ``pread``;
:class:`~gemmaspec.loading.gguf_out.StreamingGGUF` writes), whatever the checkpoint's size.

The report gives, per tensor and in total: blocks on the grid, values reproduced bit-exactly, the
worst error in units of the source's last place (ulp), the relative Frobenius error against the
source, and the same errors for what llama.cpp's Q8_0 and a plain amax/8 Q4_0 would give (both with
``gguf.quants``, llama.cpp's reference implementation in Python; measured on every 16th row of large
tensors unless ``compare_all``), plus the file sizes of exact Q4_0, Q8_0 and the source.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T

from ..errors import InputError, ModelFileError
from ..loading.gemma4_gguf import keep_f32, stream_tensor
from ..loading.gguf_out import StreamingGGUF, encode_rows
from ..loading.stored import FLOAT_MANTISSA, StoredTensor
from .q4_0_exact import QK, _ulp, pack_exact

FALLBACKS = {"q8_0": T.Q8_0, "f16": T.F16, "bf16": T.BF16, "f32": T.F32}
CHUNK_VALUES = 4 << 20  # values per block of rows read at once
COMPARE_STRIDE = 16  # every 16th row of large tensors feeds the Q8_0 / amax-Q4_0 comparison
MOSTLY_Q4_0 = 2  # llama_ftype


@dataclass
class ErrorFigures:
    """Reconstruction error of one encoding against the source."""

    sq_err: float = 0.0  # sum of squared errors
    sq_src: float = 0.0  # sum of squared source values
    max_err_ulp: float = 0.0  # worst error, in units of the source's last place

    @property
    def rel_err(self) -> float:
        """Relative Frobenius error ||W' - W|| / ||W||."""
        return math.sqrt(self.sq_err / self.sq_src) if self.sq_src > 0 else 0.0

    def add(self, other: "ErrorFigures") -> None:
        self.sq_err += other.sq_err
        self.sq_src += other.sq_src
        self.max_err_ulp = max(self.max_err_ulp, other.max_err_ulp)

    def to_json(self) -> dict:
        return {"rel_err": self.rel_err, "max_err_ulp": self.max_err_ulp}


@dataclass
class TensorReport:
    """What happened to one tensor."""

    name: str
    shape: list[int]
    source_type: str
    type: str  # what was written
    bytes: int = 0
    blocks: int = 0
    blocks_on_grid: int = 0
    values: int = 0
    values_exact: int = 0
    exact: ErrorFigures = field(default_factory=ErrorFigures)
    q8_0: ErrorFigures = field(default_factory=ErrorFigures)
    q4_0_amax: ErrorFigures = field(default_factory=ErrorFigures)
    stored: ErrorFigures = field(default_factory=ErrorFigures)  # a fallback tensor as written (sampled rows)
    compared_fraction: float = 0.0
    note: str = ""

    def to_json(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if k not in ("exact", "q8_0", "q4_0_amax", "stored")}
        if self.blocks:
            d.update(best_grid_fit=self.exact.to_json(), q8_0=self.q8_0.to_json(), q4_0_amax=self.q4_0_amax.to_json())
            d["as_stored"] = self.exact.to_json() if self.type == "Q4_0" else self.stored.to_json()
        return d


@dataclass
class QuantizeReport:
    """The evidence for one ``quantize --exact`` run (see the module docstring)."""

    source: str
    output: str
    fallback: str
    tolerance_ulp: float
    tensors: list[TensorReport] = field(default_factory=list)
    source_bytes: int = 0
    output_bytes: int = 0
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    def totals(self) -> dict:
        """Totals. Error figures compare like with like: exact Q4_0, Q8_0 and amax/8 Q4_0 over the
        tensors written as exact Q4_0; ``whole_file_rel_err`` over every weight the packer looked at,
        as stored (fallback tensors at their fallback type's error, measured like Q8_0's)."""
        looked = [t for t in self.tensors if t.blocks]
        packed = [t for t in looked if t.type == "Q4_0"]
        ex, q8, q4, whole = ErrorFigures(), ErrorFigures(), ErrorFigures(), ErrorFigures()
        for t in packed:
            ex.add(t.exact)
            q8.add(t.q8_0)
            q4.add(t.q4_0_amax)
            whole.add(t.exact)
        for t in looked:
            if t.type != "Q4_0":
                whole.add(t.stored)
        q4_blocks = sum(t.blocks for t in packed)
        return {
            "tensors": len(self.tensors),
            "tensors_q4_0": len(packed),
            "tensors_fallback": len(looked) - len(packed),
            "blocks": sum(t.blocks for t in looked),
            "blocks_on_grid": sum(t.blocks_on_grid for t in looked),
            "values": sum(t.values for t in looked),
            "values_exact": sum(t.values_exact for t in looked),
            "exact_q4_0": ex.to_json(),
            "q8_0": q8.to_json(),
            "q4_0_amax": q4.to_json(),
            "whole_file_rel_err": whole.rel_err,
            # the same file with every exact-Q4_0 tensor in Q8_0 instead: 34 instead of 18 bytes per block
            "bytes": {"exact_q4_0": self.output_bytes, "q8_0": self.output_bytes + q4_blocks * (34 - 18),
                      "source": self.source_bytes},
        }

    def to_json(self) -> dict:
        return {"source": self.source, "output": self.output, "fallback": self.fallback,
                "tolerance_ulp": self.tolerance_ulp, "seconds": self.seconds,
                "throughput_mb_s": self.source_bytes / 1e6 / self.seconds if self.seconds else None,
                "notes": self.notes, "total": self.totals(), "tensors": [t.to_json() for t in self.tensors]}

    def table(self, per_tensor: bool = True) -> str:
        """The report as text for the terminal."""
        lines = []
        if per_tensor:
            lines.append(f"{'tensor':<44} {'type':<5} {'on grid':>15} {'bit-exact':>9} {'max ulp':>7} "
                         f"{'rel err':>9} {'Q8_0':>9} {'amax Q4_0':>9}")
            for t in self.tensors:
                if not t.blocks:
                    lines.append(f"{t.name[:44]:<44} {t.type:<5} {'(' + (t.note or 'kept') + ')':>15}")
                    continue
                if t.type == "Q4_0":
                    lines.append(f"{t.name[:44]:<44} {t.type:<5} {t.blocks_on_grid:>7}/{t.blocks:<7} "
                                 f"{t.values_exact / t.values:>9.1%} {t.exact.max_err_ulp:>7.2f} {t.exact.rel_err:>9.2e} "
                                 f"{t.q8_0.rel_err:>9.2e} {t.q4_0_amax.rel_err:>9.2e}")
                else:  # fallback: the error of what was stored, not of the rejected grid fit
                    lines.append(f"{t.name[:44]:<44} {t.type:<5} {t.blocks_on_grid:>7}/{t.blocks:<7} "
                                 f"{'-':>9} {t.stored.max_err_ulp:>7.2f} {t.stored.rel_err:>9.2e} "
                                 f"{t.q8_0.rel_err:>9.2e} {t.q4_0_amax.rel_err:>9.2e}  (fallback: not on a grid)")
        s = self.totals()
        b = s["bytes"]
        if not s["blocks"]:
            lines.append("total: no BF16/F16/F32 weight to pack (every tensor was copied or kept as it was); "
                         "the input is not an unquantized checkpoint")
        else:
            lines.append(
                f"total: {s['tensors_q4_0']} tensors exact Q4_0, {s['tensors_fallback']} in the fallback ({self.fallback}); "
                f"{s['blocks_on_grid']}/{s['blocks']} blocks on the grid, {s['values_exact'] / max(1, s['values']):.1%} "
                f"of values bit-exact, worst {s['exact_q4_0']['max_err_ulp']:.2f} ulp in the Q4_0 tensors")
        if s["tensors_q4_0"]:
            ex, q8, q4 = s["exact_q4_0"]["rel_err"], s["q8_0"]["rel_err"], s["q4_0_amax"]["rel_err"]
            ratio = f" ({q8 / ex:.1f}x closer than Q8_0)" if ex > 0 else (" (Q8_0 is not)" if q8 > 0 else "")
            lines.append(f"relative error vs source over the exact-Q4_0 tensors: exact Q4_0 {ex:.2e}{ratio}, "
                         f"Q8_0 {q8:.2e}, amax/8 Q4_0 {q4:.2e}; whole file as written {s['whole_file_rel_err']:.2e}")
        lines.append(f"size: exact Q4_0 {_size(b['exact_q4_0'])}, Q8_0 {_size(b['q8_0'])} "
                     f"({1 - b['exact_q4_0'] / b['q8_0']:.0%} smaller), source {_size(b['source'])}")
        lines.extend(f"note: {n}" for n in self.notes)
        return "\n".join(lines)


def _size(n: int) -> str:
    """Bytes for people: MB (10^6) with enough digits for small files."""
    return f"{n / 1e6:.1f} MB" if n >= 10e6 else f"{n / 1e6:.3f} MB" if n >= 10e3 else f"{n} bytes"


# ---- sources -------------------------------------------------------------------------------------

@dataclass
class Source:
    """A checkpoint to read: its architecture, tensors in write order (GGUF name → StoredTensor or a
    small float32 ndarray), metadata writer and size on disk."""

    path: Path
    arch: str
    tensors: list
    add_metadata: object  # callable(writer, file_type)
    nbytes: int
    alignment: int = 32
    notes: list[str] = field(default_factory=list)


def open_source(path: str | os.PathLike) -> Source:
    """A GGUF file or a Hugging Face Gemma 4 directory as a :class:`Source`.

    Raises:
        ModelFileError: missing, corrupt, truncated or unsupported input.
    """
    path = Path(path)
    if not path.exists():
        raise ModelFileError(f"{path} does not exist; give a GGUF file or a Hugging Face checkpoint directory")
    if path.is_dir():
        from ..loading.gemma4_gguf import hf_source

        arch, tensors, add_metadata = hf_source(path)
        nbytes = sum(p.stat().st_size for p in path.glob("*.safetensors"))
        notes = []
        if any(n.startswith("masked_embd_") for n, _ in tensors):
            notes.append("the assistant's clustered-head tensors (masked_embd_centroids, masked_embd_ordering) are "
                         "kept; llama.cpp's converter drops them")
        return Source(path, arch, tensors, add_metadata, nbytes, notes=notes)
    from ..loading.gguf import check_file, open_reader

    check_file(path)
    reader = open_reader(path)
    arch_field = reader.fields.get("general.architecture")
    arch = arch_field.contents() if arch_field is not None else None
    if not arch:
        raise ModelFileError(f"{path} has no general.architecture; it is not a model GGUF")
    size = path.stat().st_size
    tensors = []
    for t in reader.tensors:
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))
        if t.data_offset + t.n_bytes > size:
            raise ModelFileError(f"{path} is truncated (tensor {t.name} runs past the end of the file); download it again")
        tensors.append((t.name, StoredTensor(path, int(t.data_offset), int(t.n_bytes), t.tensor_type.name, shape)))
    align_field = reader.fields.get("general.alignment")
    alignment = int(align_field.contents()) if align_field is not None else 32
    fields = [f for name, f in reader.fields.items()
              if not name.startswith("GGUF.") and name not in ("general.architecture", "general.file_type", "general.alignment")]

    def add_metadata(w: gguf.GGUFWriter, file_type: int) -> None:
        for f in fields:
            vtype = f.types[0]
            sub = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY and len(f.types) > 1 else None
            w.add_key_value(f.name, f.contents(), vtype, sub)
        w.add_file_type(file_type)

    return Source(path, arch, tensors, add_metadata, size, alignment)


def _packable(name: str, t) -> bool:
    return isinstance(t, StoredTensor) and t.is_float and len(t.shape) >= 2 and t.row_len % QK == 0 \
        and not keep_f32(name, t.shape)


def _compare(rows: np.ndarray, mantissa_bits: int, q8: ErrorFigures, q4: ErrorFigures) -> None:
    """Add what llama.cpp's Q8_0 and amax/8 Q4_0 (``gguf.quants``) make of ``rows`` float32 [R, K]."""
    src = rows.astype(np.float64)
    ulp = _ulp(rows, mantissa_bits)
    for qtype, fig in ((T.Q8_0, q8), (T.Q4_0, q4)):
        deq = gguf.quants.dequantize(gguf.quants.quantize(rows, qtype), qtype).astype(np.float64)
        err = deq - src
        fig.add(ErrorFigures(float((err ** 2).sum()), float((src ** 2).sum()), float((np.abs(err) / ulp).max())))


def _stored_error(rows: np.ndarray, enc: np.ndarray, qtype: T, mantissa_bits: int, fig: ErrorFigures) -> None:
    """Add the error of ``rows`` float32 [R, K] as stored: ``enc``, their ``qtype`` encoding (row order)."""
    src = rows.astype(np.float64)
    if qtype in (T.F32, T.F16):
        deq = enc.astype(np.float32)
    else:
        deq = gguf.quants.dequantize(enc.view(np.uint8).reshape(rows.shape[0], -1), qtype)
    err = deq.astype(np.float64).reshape(src.shape) - src
    fig.add(ErrorFigures(float((err ** 2).sum()), float((src ** 2).sum()), float((np.abs(err) / _ulp(rows, mantissa_bits)).max())))


class OffGridError(InputError):
    """``--strict``: a block of a 2-D weight fits no 4-bit grid."""


def _pack_tensor(s: StreamingGGUF, name: str, t: StoredTensor, rep: TensorReport, fallback: T, strict: bool,
                 tolerance_ulp: float, compare_all: bool, threads: int | None) -> None:
    mbits = FLOAT_MANTISSA[t.dtype]
    step = max(1, CHUNK_VALUES // t.row_len)
    stride = 1 if compare_all or t.rows * t.row_len <= (1 << 20) else COMPARE_STRIDE
    compared = 0
    s.begin(name, t.shape, T.Q4_0)
    off_grid = None
    for r0 in range(0, t.rows, step):
        rows = t.read_rows(r0, min(t.rows, r0 + step))
        if not np.isfinite(rows).all():
            bad = np.argwhere(~np.isfinite(rows))[0]
            raise InputError(f"{name}: the source holds NaN or Inf (row {r0 + bad[0]}, column {bad[1]}); "
                             "the checkpoint is damaged")
        r = pack_exact(rows, mbits, tolerance_ulp, threads=threads)
        rep.blocks += r.d.size
        rep.blocks_on_grid += int(r.on_grid.sum())
        rep.values += rows.size
        rep.values_exact += int(r.exact.sum())
        rep.exact.add(ErrorFigures(float(r.sq_err.sum()), float(r.sq_src.sum()), float(r.max_err_ulp.max())))
        sample = rows[(np.arange(r0, r0 + rows.shape[0]) % stride) == 0]
        if sample.size:
            compared += sample.shape[0]
            _compare(sample, mbits, rep.q8_0, rep.q4_0_amax)
        if off_grid is None and not r.on_grid.all():
            b = int(np.argmin(r.on_grid))
            per_row = t.row_len // QK
            off_grid = (r0 + b // per_row, b % per_row, float(r.max_err_ulp[b]))
            if strict:
                raise OffGridError(
                    f"{name}: block {off_grid[1]} of row {off_grid[0]} (values {off_grid[1] * QK}..{off_grid[1] * QK + 31}) "
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
    ftype = fallback if t.row_len % 32 == 0 or fallback != T.Q8_0 else T.F16
    rep.type = ftype.name
    rep.note = f"off grid at row {off_grid[0]} block {off_grid[1]}"
    s.begin(name, t.shape, ftype)
    for r0 in range(0, t.rows, step):  # written again in the fallback type; its error on the compared rows
        rows = t.read_rows(r0, min(t.rows, r0 + step))
        enc = np.ascontiguousarray(encode_rows(rows, ftype))
        s.write(enc)
        keep = (np.arange(r0, r0 + rows.shape[0]) % stride) == 0
        if keep.any():
            _stored_error(rows[keep], enc[keep], ftype, mbits, rep.stored)
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
    from tqdm import tqdm

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
                for start in range(0, t.nbytes, 64 << 20):
                    s.write(t.read_bytes(start, min(64 << 20, t.nbytes - start)))
                tr.bytes = s.end()
            else:  # integer safetensors tensor (token ordering)
                tr.type, tr.note = "I32", "kept"
                tr.bytes = stream_tensor(s, name, t, T.I32)
            bar.update(t.nbytes)
        bar.close()
        rep.output_bytes = s.finish(lambda w: src.add_metadata(w, MOSTLY_Q4_0))
    rep.seconds = time.perf_counter() - t0
    return rep


# ---- verify --------------------------------------------------------------------------------------

@dataclass
class VerifyResult:
    """Outcome of :func:`verify`: ``failures`` empty means every tensor is within its bound."""

    checked: int = 0
    by_type: dict = field(default_factory=dict)
    worst_ulp_q4_0: float = 0.0
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures


def verify(out: str | os.PathLike, against: str | os.PathLike, tolerance_ulp: float = 1.0) -> VerifyResult:
    """Re-read ``out``, dequantize every tensor and check it against the source ``against``.

    Bounds: Q4_0 tensors within ``tolerance_ulp`` units in the source's last place for every value
    (the exact packer's guarantee); Q8_0/F16/BF16/F32 tensors byte-identical to ``gguf.quants``'
    encoding of the source (what the fallback writes); copied tensors byte-identical. Every tensor of
    the source must be present, with its shape.

    Raises:
        ModelFileError: either file is missing, corrupt or truncated.
    """
    from ..loading.gguf import check_file, open_reader

    src = open_source(against)
    out = Path(out)
    check_file(out)
    reader = open_reader(out)
    res = VerifyResult()
    written = {t.name: t for t in reader.tensors}
    size = out.stat().st_size
    for name, s in src.tensors:
        t = written.pop(name, None)
        if t is None:
            res.failures.append(f"{name}: in the source but not in {out.name}")
            continue
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))
        if shape != tuple(s.shape):
            res.failures.append(f"{name}: shape {shape} in {out.name}, {tuple(s.shape)} in the source")
            continue
        if t.data_offset + t.n_bytes > size:
            raise ModelFileError(f"{out} is truncated (tensor {name}); write it again")
        qtype = t.tensor_type
        res.checked += 1
        res.by_type[qtype.name] = res.by_type.get(qtype.name, 0) + 1
        got = StoredTensor(out, int(t.data_offset), int(t.n_bytes), qtype.name, shape)
        if not isinstance(s, StoredTensor):
            ok = np.array_equal(np.frombuffer(got.read_bytes(0, got.nbytes), dtype=np.float32), s.astype(np.float32).ravel())
            if not ok:
                res.failures.append(f"{name}: differs from the computed tensor")
            continue
        if not s.is_float:  # copied (quantized or integer GGUF tensors) or integer safetensors tensors as I32
            if qtype == T.I32 and s.dtype != "I32":
                same = np.array_equal(s.load().numpy().astype(np.int32),
                                      np.frombuffer(got.read_bytes(0, got.nbytes), np.int32).reshape(shape))
            else:
                same = s.nbytes == got.nbytes and all(
                    s.read_bytes(a, min(64 << 20, s.nbytes - a)) == got.read_bytes(a, min(64 << 20, s.nbytes - a))
                    for a in range(0, s.nbytes, 64 << 20))
            if not same:
                res.failures.append(f"{name}: data differs from the source")
            continue
        block, bsize = gguf.GGML_QUANT_SIZES[qtype]
        step = max(1, CHUNK_VALUES // s.row_len)
        row_bytes = s.row_len // block * bsize
        mbits = FLOAT_MANTISSA[s.dtype]
        for r0 in range(0, s.rows, step):
            r1 = min(s.rows, r0 + step)
            want = s.read_rows(r0, r1)
            raw = np.frombuffer(got.read_bytes(r0 * row_bytes, (r1 - r0) * row_bytes), dtype=np.uint8).reshape(r1 - r0, row_bytes)
            if qtype == T.Q4_0:
                deq = gguf.quants.dequantize(raw, qtype).astype(np.float64)
                errs = np.abs(deq - want) / _ulp(want, mbits)
                worst = float(errs.max())
                res.worst_ulp_q4_0 = max(res.worst_ulp_q4_0, worst)
                if worst > tolerance_ulp:
                    r, c = np.unravel_index(int(errs.argmax()), errs.shape)
                    res.failures.append(f"{name}: row {r0 + r} column {c} is {worst:.2f} ulp off the source "
                                        f"(bound {tolerance_ulp})")
                    break
            else:
                if not np.array_equal(np.ascontiguousarray(encode_rows(want, qtype)).view(np.uint8).reshape(r1 - r0, -1), raw):
                    res.failures.append(f"{name}: {qtype.name} data is not the source's {qtype.name} encoding (rows {r0}..{r1 - 1})")
                    break
    for name in written:
        res.failures.append(f"{name}: in {out.name} but not in the source")
    return res


def write_report(rep: QuantizeReport, path: str | os.PathLike) -> None:
    """The report as JSON at ``path``."""
    Path(path).write_text(json.dumps(rep.to_json(), indent=1))
