"""Shared benchmark plumbing: cold-process runs, llama.cpp's environment, medians, tables.

llama.cpp is measured through llama-cpp-python 0.3.36, installed only here, in its own virtual
environment under ``$GEMMASPEC_HOME/bench/llama-venv``. The benchmarks import gemmaspec as installed in
the running Python (``make setup`` installs it into ``.venv``); they do not edit ``sys.path``. It builds from source (about 16 minutes on
2 cores); the wheel is kept in ``$GEMMASPEC_HOME/bench/wheels`` so the build happens once.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

try:
    from gemmaspec.paths import cache_home
except ImportError:
    sys.exit("benchmarks need gemmaspec installed in this Python: `make setup`, then run them with .venv/bin/python "
             "(or `pip install -e .`)")

LLAMA_CPP_VERSION = "0.3.36"

PROMPTS = {
    "code": "Write a Python function that parses a CSV file and returns the rows as dictionaries.",
    "prose": "Write a short story about a robot who learns to paint.",
    "qa": "Explain why the sky is blue, in simple terms.",
}


def tests_helper(name: str):
    """A helper module of the test suite (``tests/NAME.py``), loaded from its file without touching
    ``sys.path`` (the tests directory is not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"gemmaspec_tests_{name}", ROOT / "tests" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def machine() -> dict:
    """The machine a result was measured on: CPU model, its SIMD flags, cores, the kernel path gemmaspec
    built for it (``GEMMASPEC_ISA`` may force one), Python and platform."""
    from gemmaspec.kernels import kernel_isa

    cpu, flags = platform.processor(), []
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and cpu in ("", platform.processor()):
                cpu = line.split(":", 1)[1].strip()
            elif line.startswith(("flags", "Features")) and not flags:
                have = set(line.split(":", 1)[1].split())
                flags = sorted(f for f in have if f.startswith(("avx", "fma", "f16c", "sse4", "asimd", "neon", "sve")))
    except OSError:
        pass
    return {"cpu": cpu, "simd": " ".join(flags), "cores": os.cpu_count(), "kernel_isa": kernel_isa(),
            "python": platform.python_version(), "platform": platform.platform()}


def resident_bytes(path) -> int:
    """Resident bytes of this process's mappings of the file ``path`` (Linux ``/proc/self/smaps``; pass
    the path as the kernel shows it, e.g. ``os.path.realpath``)."""
    total, cur = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            p = line.split()
            if "-" in p[0] and len(p) >= 5 and ":" in p[3]:
                cur = len(p) > 5 and p[5] == str(path)
            elif cur and p[0] == "Rss:":
                total += int(p[1]) * 1024
    return total


def bench_dir() -> Path:
    """``$GEMMASPEC_HOME/bench``: the benchmarks' own venvs, wheels and converted models."""
    d = cache_home() / "bench"
    d.mkdir(parents=True, exist_ok=True)
    return d


def llama_python(build: bool = True) -> Path | None:
    """Python of the llama-cpp-python venv, creating it (and building the wheel once) if needed; with
    ``build=False``, None when it is not installed yet (nothing is built)."""
    bench = cache_home() / "bench"
    venv = bench / "llama-venv"
    py = venv / "bin" / "python"
    if py.exists() and subprocess.run([str(py), "-c", "import llama_cpp"], capture_output=True).returncode == 0:
        return py
    if not build:
        return None
    wheels = bench / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    if not list(wheels.glob(f"llama_cpp_python-{LLAMA_CPP_VERSION}-*.whl")):
        print(f"building llama-cpp-python {LLAMA_CPP_VERSION} from source (about 16 minutes, once)...", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", f"llama-cpp-python=={LLAMA_CPP_VERSION}",
                        "-w", str(wheels)], check=True, env={**os.environ, "CMAKE_ARGS": "-DGGML_NATIVE=ON"})
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(py), "-m", "pip", "install", "-q", "numpy", "typing-extensions", "diskcache", "jinja2"], check=True)
    wheel = sorted(wheels.glob(f"llama_cpp_python-{LLAMA_CPP_VERSION}-*.whl"))[-1]
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", str(wheel)], check=True)
    return py


LLAMA_TARGETS = ("llama-bench", "llama-server")
"""What :func:`llama_binaries` builds unless asked for more (``llama-mtmd-cli``: :func:`llama_mtmd_cli`)."""


def llama_source() -> Path:
    """llama.cpp's sources as vendored in llama-cpp-python's sdist (the same version as the Python
    peer), downloaded once with pip and kept, extracted, in ``$GEMMASPEC_HOME/bench/llama-src-VERSION``."""
    import tarfile

    d = bench_dir() / f"llama-src-{LLAMA_CPP_VERSION}"
    src = next(d.glob("llama_cpp_python-*/vendor/llama.cpp"), None)
    if src is not None and (src / "CMakeLists.txt").exists():
        return src
    d.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
                    f"llama-cpp-python=={LLAMA_CPP_VERSION}", "-d", str(d)], check=True)
    sdist = next(d.glob("llama_cpp_python-*.tar.gz"))
    with tarfile.open(sdist) as tf:
        tf.extractall(d, filter="data")
    sdist.unlink()
    return next(d.glob("llama_cpp_python-*/vendor/llama.cpp"))


def llama_binaries(build: bool = True, targets: tuple[str, ...] = LLAMA_TARGETS) -> Path | None:
    """Folder holding llama.cpp's own programs (``targets``: ``llama-bench`` and ``llama-server`` unless
    asked otherwise, e.g. ``llama-mtmd-cli``), built with CMake from :func:`llama_source`, for this CPU
    (``GGML_NATIVE``; AMX off: its AMX path segfaults under KVM), static, into
    ``$GEMMASPEC_HOME/bench/llama-bin-VERSION``. The CMake build folder (``llama-build-VERSION``) and
    the sources are kept, so a program asked for later compiles only what it adds. With
    ``build=False``, None when one of ``targets`` is not built yet. The first build takes ~10 minutes
    on 2 cores (``GEMMASPEC_BUILD_JOBS`` caps the parallel jobs; default: all cores)."""
    out = cache_home() / "bench" / f"llama-bin-{LLAMA_CPP_VERSION}"  # nothing created unless building
    missing = [t for t in targets if not (out / t).exists()]
    if not missing:
        return out
    if not build:
        return None
    src = llama_source()
    build_dir = bench_dir() / f"llama-build-{LLAMA_CPP_VERSION}"
    print(f"building {', '.join(missing)} {LLAMA_CPP_VERSION} (about 10 minutes the first time)...", file=sys.stderr)
    if not (build_dir / "CMakeCache.txt").exists():
        subprocess.run(["cmake", "-S", str(src), "-B", str(build_dir), "-DCMAKE_BUILD_TYPE=Release",
                        "-DGGML_NATIVE=ON", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF",
                        "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
                        "-DBUILD_SHARED_LIBS=OFF"], check=True)
    jobs = os.environ.get("GEMMASPEC_BUILD_JOBS") or str(os.cpu_count() or 2)
    subprocess.run(["cmake", "--build", str(build_dir), "-j", jobs, "--target", *missing], check=True)
    out.mkdir(parents=True, exist_ok=True)
    for t in missing:
        shutil.copy2(build_dir / "bin" / t, out / t)
    return out


def llama_mtmd_cli(build: bool = True) -> Path | None:
    """llama.cpp's multimodal command line (``llama-mtmd-cli``, ``tools/mtmd``) of the same build as
    :func:`llama_binaries` (built on first use, a few minutes when the build folder is there); with
    ``build=False``, None when it is not built yet."""
    out = llama_binaries(build, targets=("llama-mtmd-cli",))
    return None if out is None else out / "llama-mtmd-cli"


def user_env() -> dict[str, str]:
    """The user's environment for llama.cpp's programs: without what gemmaspec set for itself at import
    (``gemmaspec.SET_ENV``: ``OMP_WAIT_POLICY=passive``, which makes llama.cpp's OpenMP threads sleep
    between its ops and halved llama-bench's decode speed on a 2-core Zen 4)."""
    import gemmaspec

    return {k: v for k, v in os.environ.items() if k not in gemmaspec.SET_ENV}


def run_cold(cmd: list[str], env=None, timeout=900) -> dict:
    """Run a command in a fresh process; time to its first stdout byte, wall time, peak RSS (MB)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    first = proc.stdout.read(1)
    t_first = time.perf_counter() - t0
    out = first + proc.stdout.read()
    err = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    rc = os.waitstatus_to_exitcode(status)
    if rc != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])}... failed ({rc}): {err.decode()[-2000:]}")
    return {"first_output_s": t_first, "wall_s": wall, "peak_rss_mb": usage.ru_maxrss / 1024,
            "stdout": out.decode(errors="replace"), "stderr": err.decode(errors="replace")}


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def write_results(name: str, data: dict, table: str) -> None:
    out = ROOT / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(data, indent=2))
    (out / f"{name}.md").write_text(table + "\n")
    print(table)
    print(f"\nwritten: benchmarks/results/{name}.json, benchmarks/results/{name}.md")


@contextlib.contextmanager
def busy_process():
    """One competing CPU-bound process (``python -c 'while True: pass'``) for the duration of the
    ``with`` block: started before (given 0.3 s to get going) and killed after, whatever happens."""
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        yield busy.pid
    finally:
        busy.kill()
        busy.wait()


def cpu_busy_s() -> float | None:
    """Seconds of CPU time all processes on this machine have used since boot (``/proc/stat``: every
    state but idle and iowait, summed over CPUs); None where it cannot be read. The difference of two
    readings over a wall-clock interval is how many cores were busy."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")  # user..steal; guest time is inside user


def read_bandwidth(threads: int, mib: int = 1024, repeats: int = 7) -> dict:
    """This machine's memory read bandwidth, STREAM-like: a float32 matrix-vector product (``[mib MiB / 16
    KiB rows, 4096] @ [4096]``, PyTorch's BLAS; the access pattern of a decode step) over an array much
    larger than the last-level cache, so every pass streams it from DRAM, with ``threads`` threads and
    ``repeats`` timed passes after one warm-up. Returns GB/s (10^9 bytes/s) of the best and the median
    pass, every pass, and the settings. A few seconds on a quiet machine; load lowers it."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a = torch.ones(mib * 2**20 // (4 * 4096), 4096, dtype=torch.float32)
        v = torch.ones(4096, dtype=torch.float32)
        a @ v  # warm-up: threads started
        rates = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            a @ v
            rates.append(a.nbytes / (time.perf_counter() - t0) / 1e9)
        del a
    finally:
        torch.set_num_threads(before)
    return {"best_gbs": max(rates), "median_gbs": statistics.median(rates), "passes_gbs": rates,
            "array_mib": mib, "threads": threads, "method": "float32 matrix-vector product (torch.mv)"}
