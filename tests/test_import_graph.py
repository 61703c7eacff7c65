"""The project's import graph, read from the installed source with ast: no cycle among
its modules, and the layering DESIGN.md sets (engine/ free of the pipeline's
packages; kernels below recurrent/, recurrent/ below cpu/ and model/; core/ free of
torch; engine's subpackages depending on each other one way only).

An edge is any import of a project module, at module level or inside a function (an
import inside a function still makes the two modules depend on each other); imports
under ``if TYPE_CHECKING:`` are left out, since they never run. ``from package import
name`` depends on the package and, where ``name`` is a module, on that module too.
"""

from __future__ import annotations

import ast
import importlib.util
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

# The installed packages whose folders hold the project's source (pyproject's package-dir).
ROOT_PACKAGES = ("shardline", "shardline.engine", "shardline.tasks", "shardline.flows", "shardline.providers")
ENGINE = "shardline.engine"
# Engine subpackages that still depend on each other both ways; every other pair must
# depend one way only. None: the builder (engine/parts/) sits above the packages it
# assembles, and the module surgery (engine/surgery.py) below those it serves.
KNOWN_TWO_WAY: set[frozenset[str]] = set()


@dataclass
class ImportGraph:
    """Project modules by name, the project modules each imports (running imports only),
    and the top-level names of every package each imports (third-party included)."""

    paths: dict[str, Path] = field(default_factory=dict)
    edges: dict[str, set[str]] = field(default_factory=dict)
    top_level_imports: dict[str, set[str]] = field(default_factory=dict)


def _package_folder(package: str) -> Path:
    spec = importlib.util.find_spec(package)
    assert spec is not None and spec.submodule_search_locations, f"{package} is not an installed package"
    return Path(next(iter(spec.submodule_search_locations)))


def _module_files(package: str) -> Iterator[tuple[str, Path]]:
    """(module name, file) of every module of ``package`` and its subpackages (folders
    with an __init__.py)."""
    folder = _package_folder(package)
    for path in sorted(folder.rglob("*.py")):
        parts = path.relative_to(folder).with_suffix("").parts
        if any(not (folder.joinpath(*parts[:depth]) / "__init__.py").exists() for depth in range(1, len(parts))):
            continue  # inside a folder that is not a package (e.g. data or scripts)
        name = ".".join((package, *parts))
        yield name.removesuffix(".__init__"), path


def _type_checking_nodes(tree: ast.Module) -> set[int]:
    """ids of every node under an ``if TYPE_CHECKING:`` (or ``typing.TYPE_CHECKING``)."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            skipped.update(id(child) for statement in node.body for child in ast.walk(statement))
    return skipped


def _imported_names(module: str, is_package: bool, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The dotted names an import statement makes ``module`` depend on."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        source = ".".join([*base, *([node.module] if node.module else [])])
    else:
        source = node.module or ""
    return [source, *(f"{source}.{alias.name}" for alias in node.names)]


def build_import_graph() -> ImportGraph:
    graph = ImportGraph()
    for package in ROOT_PACKAGES:
        graph.paths.update(_module_files(package))
    for module, path in graph.paths.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        skipped = _type_checking_nodes(tree)
        is_package = path.name == "__init__.py"
        graph.edges[module] = set()
        graph.top_level_imports[module] = set()
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)) or id(node) in skipped:
                continue
            names = _imported_names(module, is_package, node)
            graph.top_level_imports[module].update(name.split(".")[0] for name in names)
            graph.edges[module].update(name for name in names if name in graph.paths and name != module)
    return graph


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the directed graph as [a, b, ..., a], or None when it is acyclic."""
    state: dict[str, str] = {}  # node -> "open" while on the current path, "done" after
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        path.append(node)
        for target in sorted(edges.get(node, ())):
            if state.get(target) == "open":
                return [*path[path.index(target):], target]
            if target not in state and (cycle := visit(target)) is not None:
                return cycle
        path.pop()
        state[node] = "done"
        return None

    for node in sorted(edges):
        if node not in state and (cycle := visit(node)) is not None:
            return cycle
    return None


@pytest.fixture(scope="module")
def graph() -> ImportGraph:
    return build_import_graph()


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _violations(graph: ImportGraph, lower: str, higher: tuple[str, ...]) -> list[str]:
    return sorted(f"{module} imports {target}" for module, targets in graph.edges.items() if _in(module, lower)
                  for target in targets if any(_in(target, package) for package in higher))


def _engine_part(module: str) -> str:
    """The engine subpackage (or top-level module) holding ``module``: "model" for
    shardline.engine.model.runner, "llm" for shardline.engine.llm."""
    return module.split(".")[2]


def test_the_graph_covers_the_project(graph):
    for module in ("shardline.cli", "shardline.engine.llm", "shardline.engine.recurrent.state",
                   "shardline.tasks.shard_job", "shardline.flows"):
        assert module in graph.paths, module
    assert "shardline.engine.recurrent.state" in graph.edges["shardline.engine.model.runner"]


def test_find_cycle_names_the_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_no_module_cycle(graph):
    cycle = find_cycle(graph.edges)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_engine_never_imports_the_pipelines_packages(graph):
    forbidden = {"prefect", "fsspec", "pyarrow"}
    found = sorted(f"{module} imports {name}" for module, names in graph.top_level_imports.items()
                   if _in(module, ENGINE) for name in names & forbidden)
    assert not found, found
    assert not _violations(graph, ENGINE, ("shardline.tasks", "shardline.flows", "shardline.providers"))


def test_kernels_import_no_higher_layer(graph):
    higher = tuple(f"{ENGINE}.{name}" for name in ("recurrent", "cpu", "model"))
    assert not _violations(graph, f"{ENGINE}.kernels", higher)


def test_recurrent_imports_neither_cpu_nor_model(graph):
    assert not _violations(graph, f"{ENGINE}.recurrent", (f"{ENGINE}.cpu", f"{ENGINE}.model"))


def test_surgery_is_below_every_package_it_serves(graph):
    """Adapters (model/), LoRA, recurrent layers and the CPU layers all replace modules
    through engine/surgery.py, which imports none of them."""
    found = sorted(target for target in graph.edges[f"{ENGINE}.surgery"] if _in(target, ENGINE))
    assert not found, found


def test_the_builder_is_above_the_packages_it_assembles(graph):
    assembled = ("model", "cpu", "lora", "recurrent", "sampling", "attention", "core")
    for package in assembled:
        assert not _violations(graph, f"{ENGINE}.{package}", (f"{ENGINE}.parts",)), package


def test_core_imports_no_torch(graph):
    found = sorted(module for module, names in graph.top_level_imports.items()
                   if _in(module, f"{ENGINE}.core") and "torch" in names)
    assert not found, found


def test_engine_subpackages_depend_one_way(graph):
    """Engine's subpackages (and its top-level modules, each a node of its own) as one
    graph: a subpackage's modules may import another's only where that one's never
    import back, directly or through others."""
    packages: dict[str, set[str]] = {}
    for module, targets in graph.edges.items():
        if not _in(module, ENGINE) or module == ENGINE:
            continue
        source = _engine_part(module)
        packages.setdefault(source, set()).update(
            _engine_part(target) for target in targets if _in(target, ENGINE) and target != ENGINE
            and _engine_part(target) != source and frozenset({source, _engine_part(target)}) not in KNOWN_TWO_WAY)
    cycle = find_cycle(packages)
    assert cycle is None, "engine subpackages depend on each other both ways: " + " -> ".join(cycle)


def test_engine_keeps_at_most_eight_top_level_modules():
    """engine/'s top level is its public surface and the loop (llm, llm_engine, config,
    params, outputs) plus the two low modules every layer may import (errors, surgery);
    everything else lives in a subpackage."""
    modules = sorted(path.name for path in _package_folder(ENGINE).glob("*.py"))
    assert len(modules) <= 8, f"engine/ has {len(modules)} top-level modules: {', '.join(modules)}"
