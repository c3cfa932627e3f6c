"""The import graph of ``compression/``, ``swarm/`` and ``peer/`` runs one way (docs/ARCHITECTURE.md).

Every module's imports are read with ``ast`` (nothing is imported), function-level and
``TYPE_CHECKING`` imports included, since both still tie the modules together. Three rules:

- every module belongs to a layer (a module added at ``swarm/`` top level must be placed);
- a layer imports only itself and the layers it is allowed (``LAYERS``; each is lower);
- no cycle between modules (so none between layers either).

A failure names the file and line of each offending import.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterable, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("compression", "swarm", "peer")

# Lowest first. A layer may import itself and the layers named here, which all come before it.
# ``swarm`` is the root of the swarm package: ``swarm/__init__.py``, ``errors``, ``version``,
# ``atomic``, ``traffic``, which import nothing of ours but each other.
LAYERS: dict[str, tuple[str, ...]] = {
    "compression": (),
    "swarm": (),
    "swarm.run": ("compression", "swarm"),
    "swarm.wire": ("swarm",),
    "swarm.dht": ("compression", "swarm", "swarm.run"),
    "peer": ("compression", "swarm", "swarm.run", "swarm.wire", "swarm.dht"),
    "swarm.client": ("compression", "swarm", "swarm.run", "swarm.wire", "swarm.dht"),
    "swarm.train": ("compression", "swarm", "swarm.run", "swarm.wire", "swarm.dht", "swarm.client"),
    "swarm.tools": (
        "compression",
        "swarm",
        "swarm.run",
        "swarm.wire",
        "swarm.dht",
        "peer",
        "swarm.client",
        "swarm.train",
    ),
    "swarm.cli": (
        "compression",
        "swarm",
        "swarm.run",
        "swarm.wire",
        "swarm.dht",
        "peer",
        "swarm.client",
        "swarm.train",
        "swarm.tools",
    ),
}
# The modules directly in swarm/ (the root layer); anything else there must go into a subpackage.
SWARM_ROOT_MODULES = frozenset({"swarm", "swarm.errors", "swarm.version", "swarm.atomic", "swarm.traffic"})

Edge = tuple[str, str, int]  # (importing module, imported module, line)


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def discover(root: Path = ROOT) -> dict[str, Path]:
    """Every module of our packages: dotted name -> file."""
    found: dict[str, Path] = {}
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            found[module_name(path, root)] = path
    return found


def _resolve(name: str, known: set[str]) -> str | None:
    """The longest prefix of ``name`` that is one of our modules (``a.b.func`` -> ``a.b``)."""
    while name:
        if name in known:
            return name
        name = name.rpartition(".")[0]
    return None


def imports_of(module: str, source: str, modules: Iterable[str]) -> list[Edge]:
    """The imports of ``module`` (given its source) that land in our modules, with their lines."""
    known = set(modules)
    is_package = any(m.startswith(module + ".") for m in known)
    edges: list[Edge] = []
    for node in ast.walk(ast.parse(source)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                anchor = module.split(".") if is_package else module.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            # ``from pkg import sub`` imports the module pkg.sub when there is one
            names = [f"{base}.{a.name}" for a in node.names] or [base]
        for name in names:
            target = _resolve(name, known)
            if target is not None and target != module:
                edges.append((module, target, node.lineno))
    return edges


def layer_of(module: str) -> str | None:
    """The layer of a module: its longest layer prefix; swarm's root modules are layer ``swarm``."""
    if module in SWARM_ROOT_MODULES:
        return "swarm"
    best = None
    for layer in LAYERS:
        if layer == "swarm":
            continue
        if (module == layer or module.startswith(layer + ".")) and (best is None or len(layer) > len(best)):
            best = layer
    return best


def layer_violations(edges: Iterable[Edge], files: Mapping[str, Path]) -> list[str]:
    order = list(LAYERS)
    problems = []
    for src, dst, line in edges:
        a, b = layer_of(src), layer_of(dst)
        if a is None or b is None or a == b or b in LAYERS[a]:
            continue
        how = "a higher layer" if order.index(b) > order.index(a) else "a layer it may not use"
        problems.append(
            f"{_where(files, src)}:{line}: {src} (layer {a}) imports {dst} (layer {b}, {how}); "
            f"{a} may import only {', '.join(LAYERS[a]) or 'nothing of ours'}"
        )
    return problems


def unplaced(modules: Iterable[str], files: Mapping[str, Path]) -> list[str]:
    return [
        f"{_where(files, m)}: {m} is in no layer; move it into one of swarm's subpackages "
        "(docs/ARCHITECTURE.md) or, if it imports nothing of ours, add it to SWARM_ROOT_MODULES"
        for m in sorted(modules)
        if layer_of(m) is None
    ]


def cycles(edges: Iterable[Edge], files: Mapping[str, Path]) -> list[str]:
    """One line per strongly connected group of modules, naming an import of each of its edges."""
    graph: dict[str, dict[str, int]] = {}
    for src, dst, line in edges:
        graph.setdefault(src, {}).setdefault(dst, line)
        graph.setdefault(dst, {})
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan; the graph has ~100 nodes, so recursion is fine
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    problems = []
    for group in groups:
        members = set(group)
        links = [
            f"{_where(files, a)}:{graph[a][b]} ({a} -> {b})"
            for a in group
            for b in sorted(graph[a])
            if b in members
        ]
        problems.append(f"import cycle between {', '.join(group)}: " + "; ".join(links))
    return problems


def _where(files: Mapping[str, Path], module: str) -> str:
    path = files.get(module)
    if path is None:
        return module
    try:
        return str(path.relative_to(ROOT))
    except ValueError:
        return str(path)


@functools.cache
def _graph() -> tuple[dict[str, Path], list[Edge]]:
    files = discover()
    edges = [e for m, p in files.items() for e in imports_of(m, p.read_text(), files)]
    return files, edges


def test_every_module_is_in_a_layer():
    files, _ = _graph()
    problems = unplaced(files, files)
    assert not problems, "\n".join(problems)


def test_imports_go_down_the_layers_only():
    files, edges = _graph()
    problems = layer_violations(edges, files)
    assert not problems, "\n".join(problems)


def test_no_import_cycles_between_modules():
    files, edges = _graph()
    problems = cycles(edges, files)
    assert not problems, "\n".join(problems)


def test_the_layer_table_lists_lower_layers_only():
    order = list(LAYERS)
    for layer, allowed in LAYERS.items():
        for other in allowed:
            assert order.index(other) < order.index(layer), (layer, other)


def test_swarm_lazy_exports_name_existing_modules_and_names():
    """``swarm.__getattr__`` resolves names through module path strings; they must stay real."""
    tree = ast.parse((ROOT / "swarm" / "__init__.py").read_text())
    lazy = next(
        ast.literal_eval(n.value)
        for n in tree.body
        if isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "_LAZY" for t in n.targets)
    )
    files = discover()
    for name, module in lazy.items():
        assert module in files, f"swarm._LAZY[{name!r}] = {module!r}: no such module"
        assert name in _top_level_names(files[module].read_text()), (
            f"swarm._LAZY[{name!r}] = {module!r}, which has no top-level {name}"
        )


def _top_level_names(source: str) -> set[str]:
    names: set[str] = set()
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.ImportFrom | ast.Import):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


# The checker itself, on made-up modules.

_FAKE = {
    "swarm.errors": "",
    "swarm.run.spec": "from swarm.errors import ConfigError\n",
    "swarm.run.model": "import torch\n\ndef f():\n    from swarm.train.trainer import Trainer\n",
    "swarm.train.trainer": "from swarm.run import model\nfrom peer.server import StagePeer\n",
    "peer.server": "from swarm.run.spec import RunSpec\n",
    "swarm.helpers": "",
    "swarm.dht.a": "from .b import x\n",
    "swarm.dht.b": "from swarm.dht.a import y\n",
}


def _fake_edges() -> tuple[dict[str, Path], list[Edge]]:
    files = {m: ROOT / (m.replace(".", "/") + ".py") for m in _FAKE}
    edges = [e for m, src in _FAKE.items() for e in imports_of(m, src, files)]
    return files, edges


def test_checker_reports_upward_and_sideways_imports_with_file_and_line():
    files, edges = _fake_edges()
    problems = layer_violations(edges, files)
    assert len(problems) == 2, problems
    up = next(p for p in problems if p.startswith("swarm/run/model.py:4:"))
    assert "imports swarm.train.trainer (layer swarm.train, a higher layer)" in up
    side = next(p for p in problems if p.startswith("swarm/train/trainer.py:2:"))
    assert "imports peer.server (layer peer, a layer it may not use)" in side


def test_checker_reports_cycles_and_unplaced_modules():
    files, edges = _fake_edges()
    found = cycles(edges, files)
    assert len(found) == 2, found  # model <-> trainer, a <-> b (a relative import)
    ab = next(p for p in found if "swarm.dht.a" in p)
    assert "swarm/dht/a.py:1 (swarm.dht.a -> swarm.dht.b)" in ab
    assert "swarm/dht/b.py:1 (swarm.dht.b -> swarm.dht.a)" in ab
    assert unplaced(files, files) == [
        "swarm/helpers.py: swarm.helpers is in no layer; move it into one of swarm's subpackages "
        "(docs/ARCHITECTURE.md) or, if it imports nothing of ours, add it to SWARM_ROOT_MODULES"
    ]
