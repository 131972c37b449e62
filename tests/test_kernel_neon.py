"""The ARM NEON path of the C kernel, built with a cross compiler and run under qemu-user, gives the
portable reference's bits for every stored format and the int8 form (skipped, with the reason, where
``aarch64-linux-gnu-gcc`` or ``qemu-aarch64`` is missing: Debian packages gcc-aarch64-linux-gnu,
libc6-dev-arm64-cross, qemu-user)."""

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from test_stored_weights import as_int8, bits, product, random_blocks

from gemmaspec import kernels

ROOT = Path(__file__).resolve().parents[1]
CC, QEMU = shutil.which("aarch64-linux-gnu-gcc"), shutil.which("qemu-aarch64")
pytestmark = pytest.mark.skipif(not (CC and QEMU), reason="no aarch64 cross compiler or qemu-aarch64 here")


def build_harness(tmp_path_factory, march: str) -> Path:
    exe = tmp_path_factory.mktemp("neon") / "harness"
    # -O1: the paths' bits are fixed by their operations (explicit intrinsics, -ffp-contract=off), not by
    # the optimization level, and the cross build takes ~8 s instead of ~80 s at -O3
    subprocess.run([CC, "-O1", f"-march={march}", "-ffp-contract=off", "-pthread", "-static",
                    str(ROOT / "tests/native/kernel_harness.c"), str(ROOT / "src/gemmaspec/kernels/qmatmul.c"),
                    "-o", str(exe), "-lm"], check=True, capture_output=True)
    return exe


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    ref = kernels.matmul_library("portable")
    if ref is None:
        pytest.skip("no C compiler: kernels fall back to torch")
    return build_harness(tmp_path_factory, "armv8.2-a"), ref


@pytest.fixture(scope="module")
def harness_dotprod(tmp_path_factory, harness):
    """The same harness built with ARM's dot-product extension (sdot in the int8-activation path)."""
    return build_harness(tmp_path_factory, "armv8.2-a+dotprod"), harness[1]


def run_neon(exe: Path, w: kernels.BlockWeight, x: np.ndarray, threads: int, q8: bool = False) -> np.ndarray:
    """The product through the NEON harness, on the segments the model's products use in that mode."""
    (fmt, raw, s, o, g, n), = w._segments_q8(kernels.load_library()) if q8 else w._segments()
    k, m = w.shape[1], x.shape[0]
    xg = w._offset_group() or 0
    header = np.array([fmt, n, k, g, m, threads, s is not None, o is not None, xg], np.int32).tobytes()
    body = [np.int64(raw.numel() * raw.element_size()).tobytes(), raw.numpy().tobytes()]
    body += [t.numpy().tobytes() for t in (s, o) if t is not None]
    inp, out = exe.with_suffix(".in"), exe.with_suffix(".out")
    inp.write_bytes(header + b"".join(body) + x.tobytes())
    subprocess.run([QEMU, str(exe), str(inp), str(out)] + (["q8"] if q8 else []), check=True, capture_output=True,
                   timeout=120)
    data = out.read_bytes()
    assert data[m * n * 4:] == b"neon"  # the NEON path really ran
    return np.frombuffer(data[:m * n * 4], np.float32).reshape(m, n)


@pytest.mark.parametrize("qtype", kernels.STORED_TYPES + ("int8-16", "int8-32-offsets"))
def test_neon_path_equals_the_portable_reference(harness, qtype):
    exe, ref = harness
    rng = np.random.default_rng(11)
    for n, k, m, threads in ((1, 256, 1, 1), (67, 512, 3, 2), (9, 256, 4, 1), (70, 256, 16, 2)):
        if qtype.startswith("int8"):
            g = 16 if qtype == "int8-16" else 32
            q = torch.from_numpy(rng.integers(-128, 128, (n, k), dtype=np.int8))
            s = torch.from_numpy(rng.standard_normal((n, k // g)).astype(np.float32))
            o = torch.from_numpy(rng.standard_normal((n, k // g)).astype(np.float32)) if "offsets" in qtype else None
            w = kernels.QuantizedWeight(q, s, o, g)
        else:
            w = kernels.StoredWeight(torch.from_numpy(random_blocks(rng, qtype, n, k)), qtype, k)
        x = rng.standard_normal((m, k)).astype(np.float32)
        want = product(ref, w, x, threads)
        assert np.array_equal(bits(run_neon(exe, w, x, threads)), bits(want)), (qtype, n, k, m)
        if not qtype.startswith("int8"):  # and the stored form equals its int8 form on the portable path
            assert np.array_equal(bits(product(ref, as_int8(w.raw.numpy(), qtype, k), x, threads)), bits(want))


@pytest.mark.parametrize("dotprod", [False, True])
@pytest.mark.parametrize("qtype", kernels.STORED_TYPES + ("Q4_0x8", "Q8_0x8", "Q5_0x8", "Q4_Kx8", "Q6_Kx8",
                                            "int8-32-offsets"))
def test_neon_int8_activation_path_equals_the_portable_reference(harness, harness_dotprod, qtype, dotprod):
    from test_kernel_q8 import q8_product, weight

    exe, ref = harness_dotprod if dotprod else harness
    rng = np.random.default_rng(12)
    for n, k, m, threads in ((1, 256, 1, 1), (67, 512, 3, 2), (70, 256, 16, 2)):
        w = weight(rng, qtype, n, k)
        x = rng.standard_normal((m, k)).astype(np.float32)
        assert np.array_equal(bits(run_neon(exe, w, x, threads, q8=True)), bits(q8_product(ref, w, x, threads))), \
            (qtype, n, k, m)
