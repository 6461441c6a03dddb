"""The module graph of ``src/``: no import cycles, and imports only go down the layers.

Every import counts, at module level, inside functions and under ``TYPE_CHECKING``: a cycle that
only type hints close still ties the modules together for a reader. The layers, bottom up:

1. the packages that carry events (``bus``, ``collector``, ``pipeline``, ``destinations``,
   ``delivery``, ``webhooks``, ``transport``) and what they share (``config``, ``errors``,
   ``http``, ``jvm``);
2. what operators look at (``ops``) and the console's site (``console``);
3. the processes users run (``roles``);
4. the command line (``cli``) and the test helpers (``testing``).

One exception, by design: ``config.model`` assembles the file's model from every package's own
section (``<package>.config``, as the console's is ``console.config``), so it may import any
package's ``config`` module, and those modules import nothing above the first layer.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

LAYERS: Mapping[str, int] = {
    **dict.fromkeys(
        [
            "errors",
            "config",
            "http",
            "jvm",
            "bus",
            "collector",
            "pipeline",
            "destinations",
            "delivery",
            "webhooks",
            "transport",
        ],
        1,
    ),
    "ops": 2,
    "console": 2,
    "roles": 3,
    "cli": 4,
    "testing": 4,
    "__main__": 4,
}


def modules(root: Path) -> dict[str, Path]:
    """Every module under ``root`` by dotted name (a package by its own name)."""
    found = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _known(name: str, known: Mapping[str, Path]) -> str | None:
    """The module that ``name`` (a module, or a name inside one) is, among ``known``."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def imports(name: str, path: Path, known: Mapping[str, Path]) -> Iterator[str]:
    """The modules among ``known`` that module ``name`` imports, anywhere in its text."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, *([base] if base else [])])
            # `from pkg import sub` imports pkg (its __init__ runs) and, if it is one, pkg.sub
            targets = [base, *(f"{base}.{alias.name}" for alias in node.names)]
        else:
            continue
        for target in targets:
            found = _known(target, known)
            if found is not None and found != name:
                yield found


def graph(root: Path) -> dict[str, set[str]]:
    known = modules(root)
    return {name: set(imports(name, path, known)) for name, path in known.items()}


def cycles(edges: Mapping[str, set[str]]) -> list[list[str]]:
    """Groups of two or more modules that import each other around a loop (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
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

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return groups


def layer(module: str) -> int | None:
    parts = module.split(".")
    return LAYERS.get(parts[1]) if len(parts) > 1 else 0


def is_section(module: str) -> bool:
    """A package's own part of the configuration (``headwater.<package>.config``)."""
    parts = module.split(".")
    return len(parts) == 3 and parts[2] == "config"


def upward(edges: Mapping[str, set[str]]) -> list[str]:
    """Imports from a module into a layer above its own (a configuration section counts as the
    first layer: ``config.model`` assembles them all)."""
    found = []
    for a, targets in sorted(edges.items()):
        for b in sorted(targets):
            la = 1 if is_section(a) else layer(a)
            lb = 1 if a == "headwater.config.model" and is_section(b) else layer(b)
            if la is not None and lb is not None and lb > la:
                found.append(f"{a} -> {b}")
    return found


def test_src_has_no_import_cycles() -> None:
    assert cycles(graph(SRC)) == []


def test_imports_only_go_down_the_layers() -> None:
    assert upward(graph(SRC)) == []


def test_every_package_has_a_layer() -> None:
    packages = {
        p.name for p in (SRC / "headwater").iterdir() if p.is_dir() and p.name != "__pycache__"
    }
    packages |= {p.stem for p in (SRC / "headwater").glob("*.py") if p.stem != "__init__"}
    assert packages - set(LAYERS) == set(), "a new package needs its place in LAYERS"


def test_the_check_finds_a_cycle_and_an_upward_import(tmp_path: Path) -> None:
    """The walk sees function-level, TYPE_CHECKING and `from package import module` imports."""
    pkg = tmp_path / "headwater"
    for folder in ("bus", "roles", "pipeline/source"):
        (pkg / folder).mkdir(parents=True)
        (pkg / folder / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "bus" / "a.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from headwater.bus.b import B\n"
    )
    (pkg / "bus" / "b.py").write_text("def f():\n    from headwater.bus import a\n")
    (pkg / "bus" / "c.py").write_text("def f():\n    import headwater.roles.up\n")
    (pkg / "roles" / "up.py").write_text("")
    (pkg / "pipeline" / "source" / "__init__.py").write_text("from .reader import R\n")
    (pkg / "pipeline" / "source" / "reader.py").write_text(
        "from headwater.pipeline.source import offsets\n"
    )
    (pkg / "pipeline" / "source" / "offsets.py").write_text("")
    edges = graph(tmp_path)
    assert cycles(edges) == [
        ["headwater.bus.a", "headwater.bus.b"],
        ["headwater.pipeline.source", "headwater.pipeline.source.reader"],
    ]
    assert upward(edges) == ["headwater.bus.c -> headwater.roles.up"]
