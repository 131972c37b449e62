"""The package's shape: no import cycles; only ``models/`` and ``loading/`` know architectures; argument
parsing only in ``cli/``; no file over 600 lines and no function over 120 lines (each exception listed
with its reason)."""

import ast
from pathlib import Path

import grimp

import gemmaspec
from gemmaspec.models.registry import ARCHITECTURES

SRC = Path(gemmaspec.__file__).parent
MODEL_CLASSES = {"Gemma3Model", "Gemma4Model", "Gemma4Assistant", "Gemma3Config", "Gemma4Config",
                 "Gemma4AssistantConfig"}


def test_no_import_cycles():
    graph = grimp.build_graph("gemmaspec")
    cycles = sorted({tuple(sorted((m, n))) for m in graph.modules
                     for n in graph.find_modules_directly_imported_by(m)
                     if graph.chain_exists(importer=n, imported=m)})
    assert not cycles, f"import cycles: {cycles}"


def _architecture_mentions(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and node.value in ARCHITECTURES:
            found.append(f"{path.name}:{node.lineno} the string {node.value!r}")
        elif isinstance(node, ast.Name) and node.id in MODEL_CLASSES:
            found.append(f"{path.name}:{node.lineno} {node.id}")
        elif isinstance(node, ast.ImportFrom) and node.module and (".models." in f".{node.module}."
                                                                   and not node.module.endswith("base")):
            found.append(f"{path.name}:{node.lineno} imports {node.module}")
    return found


ARCHITECTURE_EXCEPTIONS = {
    "manage/fit.py": "sizes a checkpoint from its metadata before loading: the per-architecture tensor shapes, KV "
                     "layers and step buffers come from models/footprint.py (no branch on an architecture here)",
}
"""Modules outside ``models/`` and ``loading/`` allowed to import a model module, with the reason."""


def test_only_models_and_loading_know_architectures():
    """Everything else works through the model contract (models/base.py) and the registry's roles."""
    outside = [p for p in SRC.rglob("*.py") if p.relative_to(SRC).parts[0] not in ("models", "loading")
               and p.relative_to(SRC).as_posix() not in ARCHITECTURE_EXCEPTIONS]
    assert len(outside) > 10  # the walk really looked at the package
    mentions = [m for p in outside for m in _architecture_mentions(p)]
    assert not mentions, mentions
    for rel in ARCHITECTURE_EXCEPTIONS:  # an exception may import footprint, never branch on a class or arch name
        found = _architecture_mentions(SRC / rel)
        assert found and all("imports models.footprint" in m for m in found), (rel, found)


def _imports(tree) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_argument_parsing_only_in_the_cli_package():
    """Every command's flags are read in ``cli/``; the library takes settings (SpecConfig, SamplingParams,
    ServeConfig), never an argparse namespace of its own making."""
    parsers = [p.relative_to(SRC).as_posix() for p in SRC.rglob("*.py")
               if "argparse" in _imports(ast.parse(p.read_text()))]
    assert parsers and all(p.startswith("cli/") for p in parsers), parsers


LONG_FILES = {}
"""Files allowed over :data:`MAX_FILE_LINES`, with the reason."""
LONG_FUNCTIONS = {}
"""Functions (``path:name``) allowed over :data:`MAX_FUNCTION_LINES`, with the reason."""
MAX_FILE_LINES, MAX_FUNCTION_LINES = 600, 120


def _sizes(path: Path):
    text = path.read_text()
    funcs = {f"{path.relative_to(SRC).as_posix()}:{n.name}": n.end_lineno - n.lineno + 1
             for n in ast.walk(ast.parse(text)) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    return len(text.splitlines()), funcs


def test_no_long_files_or_functions():
    long_files, long_funcs = [], []
    for p in SRC.rglob("*.py"):
        lines, funcs = _sizes(p)
        if lines > MAX_FILE_LINES and p.relative_to(SRC).as_posix() not in LONG_FILES:
            long_files.append((p.relative_to(SRC).as_posix(), lines))
        long_funcs += [(k, n) for k, n in funcs.items() if n > MAX_FUNCTION_LINES and k not in LONG_FUNCTIONS]
    assert not long_files, f"files over {MAX_FILE_LINES} lines (split them or list a reason): {long_files}"
    assert not long_funcs, f"functions over {MAX_FUNCTION_LINES} lines: {long_funcs}"


def test_the_size_check_counts(tmp_path, monkeypatch):
    """The size check is not blind: a 130-line function is measured as such."""
    body = "def f():\n" + "    x = 1\n" * 129
    (tmp_path / "m.py").write_text(body)
    monkeypatch.setattr(__import__(__name__), "SRC", tmp_path)
    lines, funcs = _sizes(tmp_path / "m.py")
    assert lines == 130 and funcs == {"m.py:f": 130}


def test_the_check_sees_a_branch(tmp_path):
    """The scan above is not blind: a module that branches on a model class or an arch string is caught."""
    bad = tmp_path / "bad.py"
    bad.write_text("from gemmaspec.models.gemma4 import Gemma4Model\n"
                   "def f(m, arch):\n    return isinstance(m, Gemma4Model) or arch == 'gemma4'\n")
    assert len(_architecture_mentions(bad)) == 3
