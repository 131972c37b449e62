"""The package's shape: no import cycles, and only ``models/`` and ``loading/`` know architectures."""

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


def test_only_models_and_loading_know_architectures():
    """Everything else works through the model contract (models/base.py) and the registry's roles."""
    outside = [p for p in SRC.rglob("*.py") if p.relative_to(SRC).parts[0] not in ("models", "loading")]
    assert len(outside) > 10  # the walk really looked at the package
    mentions = [m for p in outside for m in _architecture_mentions(p)]
    assert not mentions, mentions


def test_the_check_sees_a_branch(tmp_path):
    """The scan above is not blind: a module that branches on a model class or an arch string is caught."""
    bad = tmp_path / "bad.py"
    bad.write_text("from gemmaspec.models.gemma4 import Gemma4Model\n"
                   "def f(m, arch):\n    return isinstance(m, Gemma4Model) or arch == 'gemma4'\n")
    assert len(_architecture_mentions(bad)) == 3
