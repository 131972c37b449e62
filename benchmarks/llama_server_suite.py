"""Run llama.cpp's own server test suite (``tools/server/tests``) against ``gemmaspec serve``.

The suite comes from the llama.cpp that llama-cpp-python vendors (its source distribution, version
``LLAMA_CPP_VERSION`` from ``common.py``, fetched once with pip into the gemmaspec cache). Each test
starts "llama-server" through ``LLAMA_SERVER_BIN_PATH``, here a wrapper around
``benchmarks/llama_server_shim.py`` (flags translated, every model replaced by gemmaspec's default
model, unsupported features refused at start). The session-wide model downloads
(``ServerPreset.load_all``) are skipped; ``wget`` (used only to download) is a stub.

    python benchmarks/llama_server_suite.py [FILE ...]   # e.g. test_tokenize.py; default: all of unit/
    python benchmarks/llama_server_suite.py --from-xml   # the table again from the last per-file results

Writes ``benchmarks/results/llama_server_suite.{json,md}``: per file, tests passed / failed / errors
/ skipped, and every failure with a category: ``unsupported`` (the shim refused a flag: embeddings,
reranking, LoRA, images, router mode, server tools), ``needs a download`` (a model or projector
fetched from Hugging Face inside the test), ``model output`` (an assertion on the text or token
counts of llama.cpp's test models, which a different model cannot meet), ``other``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from common import LLAMA_CPP_VERSION, cache_home

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PLUGIN = '''
import utils
utils.ServerPreset.load_all = staticmethod(lambda: None)  # no model downloads: the shim serves gemmaspec's model
'''
WGET = '''
def download(url, out=None):
    raise RuntimeError("no downloads in the gemmaspec shim run: " + url)
'''


def suite_dir() -> Path:
    """llama.cpp's ``tools/server/tests`` from llama-cpp-python's sdist, extracted once into the cache,
    with ``models/templates`` beside it as in llama.cpp's tree (tests name chat templates by the
    path ``../../../models/templates/NAME.jinja``)."""
    base = cache_home() / "bench" / f"llama-server-tests-{LLAMA_CPP_VERSION}"
    tests = base / "tools" / "server" / "tests"
    if (tests / "utils.py").exists() and (base / "models" / "templates").is_dir():
        return tests
    base.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        f"llama-cpp-python=={LLAMA_CPP_VERSION}", "-d", tmp], check=True)
        sdist = next(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        prefixes = ("vendor/llama.cpp/tools/server/tests/", "vendor/llama.cpp/models/templates/")
        with tarfile.open(sdist) as tar:
            for m in tar.getmembers():
                rel = m.name.split("/", 1)[1] if "/" in m.name else ""
                if rel.startswith(prefixes) and m.isfile():
                    dest = base / rel[len("vendor/llama.cpp/"):]
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    dest.write_bytes(tar.extractfile(m).read())
    return tests


def support_dir() -> Path:
    d = cache_home() / "bench" / "llama-server-shim"
    d.mkdir(parents=True, exist_ok=True)
    (d / "gemmaspec_suite_plugin.py").write_text(PLUGIN)
    (d / "wget.py").write_text(WGET)
    wrapper = d / "llama-server"
    wrapper.write_text(f"#!/bin/sh\nexec {sys.executable} {HERE / 'llama_server_shim.py'} \"$@\"\n")
    wrapper.chmod(0o755)
    return d


def categorize(message: str, output: str) -> str:
    if "Server process died with return code 2" in output:  # the shim refused a flag (its stderr is not kept)
        return "unsupported"
    if re.search(r"huggingface\.co|wget|no downloads", output):
        return "needs a download"
    failing = [ln for ln in output.splitlines() if ln.startswith(">")]
    line = failing[-1] if failing else message
    if re.search(r"match_regex|re\.(search|match)|\b(content|n_tokens|tokens|tokens_predicted|predicted_n|prompt_n|"
                 r"n_prompt|completion_tokens|prompt_tokens|text|bosId|n_probs|probs|logprobs)\b", line):
        return "model output"
    return "other: " + (message.strip().splitlines() or [""])[0][:160]


def run_file(tests: Path, support: Path, name: str, port: int, timeout: int) -> dict:
    xml = support / f"{name}.xml"
    xml.unlink(missing_ok=True)
    env = {**os.environ, "LLAMA_SERVER_BIN_PATH": str(support / "llama-server"), "PORT": str(port),
           "PYTHONPATH": os.pathsep.join([str(support), str(tests), str(ROOT / "src")])}
    t0 = time.perf_counter()
    try:
        subprocess.run([sys.executable, "-m", "pytest", f"unit/{name}", "-p", "gemmaspec_suite_plugin", "-m",
                        "not slow", "-q", "-o", "addopts=", f"--junitxml={xml}"],
                       cwd=tests, env=env, timeout=timeout, capture_output=True, text=True)
    except subprocess.TimeoutExpired:
        pass
    return parse_xml(xml, name, round(time.perf_counter() - t0), timeout)


def parse_xml(xml: Path, name: str, seconds: int, timeout: int) -> dict:
    """One file's counts and categorized failures from its JUnit XML."""
    out = {"file": name, "seconds": seconds, "passed": 0, "failed": 0, "errors": 0, "skipped": 0, "failures": []}
    if not xml.exists():
        out["errors"] = -1
        out["failures"].append({"test": name, "category": f"other: no result within {timeout} s"})
        return out
    for case in ET.parse(xml).getroot().iter("testcase"):
        test = case.get("name")
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        if case.find("skipped") is not None:
            out["skipped"] += 1
        elif bad is not None:
            out["failed" if bad.tag == "failure" else "errors"] += 1
            text = "".join(case.itertext())
            out["failures"].append({"test": test, "category": categorize(bad.get("message") or "", text)})
        else:
            out["passed"] += 1
    return out


def main() -> None:
    args = sys.argv[1:]
    from_xml = "--from-xml" in args  # summarize the files' last results without running anything
    args = [a for a in args if a != "--from-xml"]
    tests, support = suite_dir(), support_dir()
    names = args or sorted(p.name for p in (tests / "unit").glob("test_*.py"))
    res = HERE / "results"
    old = {}
    if args and (res / "llama_server_suite.json").exists():
        old = {r["file"]: r for r in json.loads((res / "llama_server_suite.json").read_text())["files"]}
    for i, name in enumerate(names):
        if from_xml:
            if not (support / f"{name}.xml").exists():
                continue
            r = parse_xml(support / f"{name}.xml", name, old.get(name, {}).get("seconds", 0), 0)
        else:
            r = run_file(tests, support, name, 18080 + 10 * (i % 50), timeout=1800)
        old[name] = r
        print(f"{name}: {r['passed']} passed, {r['failed']} failed, {r['errors']} errors, {r['skipped']} skipped "
              f"({r['seconds']} s)", flush=True)
        write(res, old)


def write(res: Path, old: dict) -> None:
    files = [old[k] for k in sorted(old)]
    out = {"llama_cpp": f"llama-cpp-python {LLAMA_CPP_VERSION} sdist (vendored llama.cpp)", "files": files}
    (res / "llama_server_suite.json").write_text(json.dumps(out, indent=1))
    lines = ["| file | passed | failed | errors | skipped | unsupported | needs a download | model output | other |",
             "|---|---|---|---|---|---|---|---|---|"]
    tot = [0] * 8
    for r in files:
        cats = [f["category"] for f in r["failures"]]
        row = [r["passed"], r["failed"], r["errors"], r["skipped"], sum(c == "unsupported" for c in cats),
               sum(c == "needs a download" for c in cats), sum(c == "model output" for c in cats),
               sum(c.startswith("other") for c in cats)]
        tot = [a + b for a, b in zip(tot, row)]
        lines.append(f"| {r['file']} | " + " | ".join(map(str, row)) + " |")
    lines.append("| **all** | " + " | ".join(f"**{t}**" for t in tot) + " |")
    (res / "llama_server_suite.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
