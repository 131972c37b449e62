"""The mmproj GGUFs `gemmaspec convert --mmproj` writes load in llama.cpp's `llama-mtmd-cli` and give
the same image token count and greedy text as `gemmaspec generate --image` (benchmarks/mmproj_check.py,
on the images that neither side resizes; greedy tokens equal, or parting late at a near tie).

CI does not build llama.cpp: these tests run only where `llama-mtmd-cli` was built already
(``python -c 'import common; common.llama_mtmd_cli()'`` in benchmarks/, or `benchmarks/mmproj_check.py
--build`)."""

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _check_module():
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location("gemmaspec_bench_mmproj_check", BENCH / "mmproj_check.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.path.remove(str(BENCH))


def _cli():
    try:
        mod = _check_module()
    except ImportError as exc:  # pragma: no cover - a missing optional package
        return None, f"benchmarks/mmproj_check.py does not import here: {exc}"
    cli = mod.llama_mtmd_cli(build=False)
    if cli is None:
        return None, ("llama-mtmd-cli is not built here (CI does not build llama.cpp): run "
                      "`python benchmarks/mmproj_check.py --build` once")
    return mod, cli


@pytest.mark.parametrize("case", ["gemma3 56x56", "gemma4 240x168"])
def test_llama_cpp_reads_our_mmproj_and_agrees(case, tmp_path):
    mod, cli = _cli()
    if mod is None:
        pytest.skip(cli)
    arch, w, h, extra, _ = mod.CASES[case]
    target, mmproj = (mod.gemma3_files if arch == "gemma3" else mod.gemma4_files)(tmp_path)
    image = mod.image_file(tmp_path / "a.png", w, h, seed=w * 1000 + h)
    marker = "<start_of_image>" if arch == "gemma3" else "<|image|>"
    lmark = f"\n\n{mod.MARK}\n\n" if arch == "gemma3" else mod.MARK
    ll = mod.run_llama(cli, target, mmproj, image, mod.TURN.format(image=lmark), 6, extra)
    ours = mod.run_ours(target, mmproj, image, mod.TURN.format(image=marker), 6)
    assert ll["ok"] and ll["loaded"], ll["log_tail"]
    assert ours["ok"], ours["error"]
    assert ll["projector"] == ("gemma3" if arch == "gemma3" else "gemma4v")
    assert ll["image_tokens"] == ours["image_tokens"] == (4 if arch == "gemma3" else 280)
    assert ours["text"].strip()
    if ll["text"].strip() != ours["text"].strip():
        # float rounding may flip a near tie late in random text: then llama.cpp's token is gemmaspec's
        # runner-up by a hair, after several equal tokens (a different computation parts at once, widely)
        part = mod.parting(ll["text"], ours)
        assert part and part["step"] >= 3 and part["llama_token_rank_in_gemmaspec"] == 2, part
        assert part["margin"] < 0.05, part
