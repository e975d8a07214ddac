"""The import layers of ``docs/architecture.md``, held against every import in ``lightning_smp/``: at the top of a
module, inside a function, or under ``TYPE_CHECKING`` (a dependency all the same)."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

import lightning_smp

PACKAGE = Path(lightning_smp.__file__).parent
ARCHITECTURE = PACKAGE.parent / "docs" / "architecture.md"


def _module_names() -> dict[str, Path]:
    names = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


MODULES = _module_names()


def _imported(module: str, path: Path) -> Iterator[tuple[str, int]]:
    """Every module of the package that ``module`` imports, with the line: ``from a.b import c`` imports ``a.b.c``
    where that is a module, else ``a.b``."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            if target and target != module:
                yield target, node.lineno


IMPORTS = {module: sorted(set(_imported(module, path))) for module, path in MODULES.items()}


def unit(module: str) -> str:
    """The unit a layer lists: a top-level module or a subpackage (``engines`` for ``lightning_smp.engines.fsdp1``);
    ``__init__`` for the package itself."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def documented_layers() -> list[tuple[str, list[str]]]:
    """The numbered list under "## Layers" in docs/architecture.md: ``1. **name**: `unit`, `unit` ...``."""
    text = ARCHITECTURE.read_text().split("## Layers", 1)[1].split("\n## ", 1)[0]
    layers = []
    for match in re.finditer(r"^\d+\. \*\*([^*]+)\*\*[^:]*: (.+)$", text, re.MULTILINE):
        layers.append((match.group(1), re.findall(r"`([\w.]+)`", match.group(2))))
    return layers


LAYERS = documented_layers()
LAYER_OF = {name: index for index, (_, units) in enumerate(LAYERS) for name in units}


def test_the_layer_list_is_read_and_names_every_unit_once():
    assert len(LAYERS) >= 6
    listed = [name for _, units in LAYERS for name in units]
    assert len(listed) == len(set(listed)), "a unit is listed in two layers"
    assert set(listed) == {unit(module) for module in MODULES}, "every module and subpackage is in one layer"


def test_no_module_imports_from_a_later_layer():
    wrong = [f"{module}:{line} imports {target}, whose layer ({LAYERS[LAYER_OF[unit(target)]][0]}) comes after its"
             f" own ({LAYERS[LAYER_OF[unit(module)]][0]})"
             for module, imports in IMPORTS.items() for target, line in imports
             if LAYER_OF[unit(target)] > LAYER_OF[unit(module)]]
    assert not wrong, "\n".join(wrong)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in graph.get(node, ()):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                other = stack.pop()
                component.append(other)
                if other == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


@pytest.mark.parametrize("level", ["module", "unit"])
def test_no_import_cycle(level):
    """No module imports one that imports it back (through any chain), and no unit of a layer imports another of the
    same layer that imports it back."""
    key = (lambda m: m) if level == "module" else unit
    graph: dict[str, set[str]] = {}
    for module, imports in IMPORTS.items():
        graph.setdefault(key(module), set()).update(key(target) for target, _ in imports if key(target) != key(module))
    assert not _cycles(graph)


def test_the_layer_test_finds_what_it_looks_for():
    """The parser sees imports inside functions and relative ones; the cycle finder finds a cycle."""
    planner = IMPORTS["lightning_smp.planner.choose"]
    assert any(target == "lightning_smp.planner.activations" for target, _ in planner)  # inside a function
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert unit("lightning_smp.engines.fsdp1.engine") == "engines" and unit("lightning_smp") == "__init__"


# ---------------------------------------------------------------------------------------------- engine facts

#: how code outside ``engines/`` would name one engine: its class, its instance, an ``fsdp_version`` value or an
#: engine's name in a message, an engine picked by a literal version
_ENGINE_NAMES = {"FSDP1Engine", "FSDP2Engine", "DDPEngine", "DDP_ENGINE", "FSDP1Prediction", "FSDP2Prediction",
                 "DDPPrediction"}
_ENGINE_TEXT = re.compile(r"fsdp_version=\d|\bfsdp\d\b|\bddp\b")


def _engine_namings(path: Path) -> Iterator[str]:
    tree = ast.parse(path.read_text(), str(path))
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    for node in ast.walk(tree):
        named = getattr(node, "id", None) or getattr(node, "attr", None) or getattr(node, "name", None)
        if isinstance(node, (ast.Name, ast.Attribute, ast.alias)) and named in _ENGINE_NAMES:
            yield f"line {getattr(node, 'lineno', '?')}: {named}"
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
              and _ENGINE_TEXT.search(node.value)):
            yield f"line {node.lineno}: {node.value[:60]!r}"
        elif (isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "engine_for"
              and node.args and isinstance(node.args[0], ast.Constant)):
            yield f"line {node.lineno}: engine_for({node.args[0].value!r})"


def test_no_module_outside_the_engines_names_an_engine():
    """Engine facts live with the engine: its ``Capabilities`` (what fault tolerance needs, which accumulation modes,
    manual optimization), its prediction (the planner's units), and a fix that names an ``fsdp_version`` asks the
    registry which engines can (``engines.selected_by``). Elsewhere no engine class or instance, no literal engine
    name or ``fsdp_version=<n>`` in a message, no engine picked by a literal version. (Docstrings, and the options'
    own documentation, describe the engines.)"""
    found = {str(path.relative_to(PACKAGE)): list(_engine_namings(path)) for path in sorted(PACKAGE.rglob("*.py"))
             if path.relative_to(PACKAGE).parts[0] != "engines"}
    assert {module: namings for module, namings in found.items() if namings} == {}


def test_the_engine_scan_finds_what_it_looks_for(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text('from lightning_smp.engines import DDP_ENGINE\n\ndef f(engine):\n    """fsdp_version=2 here is prose."""'
                      '\n    raise ValueError("Fix: pass fsdp_version=2")\n\nengine_for(2)\n')
    assert len(list(_engine_namings(sample))) == 3


def _backup_literals(path: Path) -> Iterator[tuple[int, str]]:
    """Comparisons of something named ``backup`` with a literal ``replica_sync`` backup value (``"cpu"``, ...)."""
    from lightning_smp.names import REPLICA_SYNC_BACKUPS

    source = path.read_text()
    for node in ast.walk(ast.parse(source, str(path))):
        if isinstance(node, ast.Compare) and any(
                isinstance(side, ast.Constant) and side.value in REPLICA_SYNC_BACKUPS
                for side in (node.left, *node.comparators)):
            text = ast.get_source_segment(source, node) or ""
            if "backup" in text:
                yield node.lineno, text


def test_the_replica_sync_backups_are_compared_by_their_names():
    """``replica_sync``'s ``backup`` values are named once (``names.BACKUP_DEVICE``, ``names.BACKUP_CPU``): no module
    compares a backup with a literal of its own."""
    found = {str(path.relative_to(PACKAGE)): list(_backup_literals(path)) for path in sorted(PACKAGE.rglob("*.py"))}
    assert {module: literals for module, literals in found.items() if literals} == {}


def test_the_backup_scan_finds_what_it_looks_for(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text('def f(sync, record):\n    return sync.backup == "device" or record.get("replica_sync_backup")'
                      ' != "cpu" or sync.device.type == "cpu"\n')
    assert [line for line, _ in _backup_literals(sample)] == [2, 2]
