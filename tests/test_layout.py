"""poprun's import structure, read from the sources (docs/architecture.md, "Layers and data
flow" and "Module map"). Pure: every module is parsed with `ast`, nothing is imported or run.

- Imports only go down the layers: cli (5) > run (4) > jobctl (3) > view (2) > plan (1) >
  the leaves (0, the modules directly in src/poprun/). A module may import its own
  subpackage's modules and any lower layer's, never a higher one's; imports inside functions
  count too. `poprun/__init__.py` and `poprun/__main__.py` are the entry points: exempt.
- No import cycle among poprun's modules: none among top-level imports, and none once the
  imports inside functions (lazy) are counted too.
- `spawner` and `popdist` import nothing of poprun but `poprun._version`.
- Every module file under src/poprun is in the architecture's module map.
- Nothing under src/ or tests/, nor docs/architecture.md, cites a tracker issue by its number:
  a reader of the code cannot open it, so the text says the behaviour or the defect instead.

A failure names each offending import as `file:line: statement`.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src"
DOC = ROOT / "docs" / "architecture.md"

# The layers, top to bottom; a module directly in src/poprun/ is a leaf (rank 0).
RANKS = {"cli": 5, "run": 4, "jobctl": 3, "view": 2, "plan": 1}
LEAF_RANK = 0
ENTRY_POINTS = {"poprun", "poprun.__main__"}  # poprun/__init__.py, poprun/__main__.py
VERSION_MODULE = "poprun._version"  # all that spawner and popdist may import of poprun


# ------------------------------------------------------------------------- reading the tree


@dataclass(frozen=True)
class Import:
    importer: str  # dotted name of the importing module
    target: str  # dotted name of the module the statement loads (resolved against the tree)
    path: Path
    line: int
    lazy: bool  # inside a function: runs on first use, not at import time
    runtime: bool  # False under `if TYPE_CHECKING:`
    statement: str

    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}: {self.statement}"


def module_files(package: str) -> dict[str, Path]:
    """Dotted module name -> file, for every module of `package` under src/."""
    found = {}
    for path in sorted((SRC / package).rglob("*.py")):
        rel = path.relative_to(SRC)
        if "__pycache__" in rel.parts or any(p.endswith(".egg-info") for p in rel.parts):
            continue
        parts = list(rel.with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES: dict[str, Path] = {}
for _package in ("poprun", "spawner", "popdist"):
    MODULES.update(module_files(_package))
POPRUN_MODULES = {name: path for name, path in MODULES.items()
                  if name == "poprun" or name.startswith("poprun.")}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _statement(source: str, node: ast.AST) -> str:
    text = ast.get_source_segment(source, node) or ast.unparse(node)
    return " ".join(text.split())


def imports_of(name: str, path: Path) -> list[Import]:
    """Every import statement of one module, wherever it is (functions, classes, ifs, trys),
    each resolved to the module it loads: `from a.b import c` loads a.b.c when that is a
    module of the tree, else a.b."""
    source = path.read_text(encoding="utf-8")
    tree = ast.parse(source, filename=str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[Import] = []

    def add(node: ast.AST, target: str, lazy: bool, runtime: bool) -> None:
        found.append(Import(name, target, path, node.lineno, lazy, runtime,
                            _statement(source, node)))

    def visit(node: ast.AST, lazy: bool, runtime: bool) -> None:
        for child in ast.iter_child_nodes(node):
            child_lazy, child_runtime = lazy, runtime
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                child_lazy = True
            if isinstance(child, ast.Import):
                for alias in child.names:
                    add(child, alias.name, lazy, runtime)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")
                    base = base[:len(base) - (child.level - 1)]
                    module = ".".join(base + ([child.module] if child.module else []))
                else:
                    module = child.module or ""
                for alias in child.names:
                    sub = f"{module}.{alias.name}"
                    add(child, sub if sub in MODULES else module, lazy, runtime)
            elif isinstance(child, ast.If) and _is_type_checking(child.test):
                # The body never runs; the else branch (if any) always does.
                for stmt in child.body:
                    visit(ast.Module(body=[stmt], type_ignores=[]), lazy, False)
                for stmt in child.orelse:
                    visit(ast.Module(body=[stmt], type_ignores=[]), lazy, runtime)
                continue
            visit(child, child_lazy, child_runtime)

    visit(tree, False, True)
    return found


IMPORTS: list[Import] = [imp for name, path in MODULES.items() for imp in imports_of(name, path)]


def in_poprun(target: str) -> bool:
    return target == "poprun" or target.startswith("poprun.")


def rank(module: str) -> int:
    """The layer of a poprun module (or of a name under it that is not a module)."""
    parts = module.split(".")
    if len(parts) >= 2 and parts[1] in RANKS:
        return RANKS[parts[1]]
    return LEAF_RANK


def layer(module: str) -> str:
    parts = module.split(".")
    return f"{parts[1]}/" if len(parts) >= 2 and parts[1] in RANKS else "the leaves"


# ------------------------------------------------------------------------- (a) the layers


def test_every_subpackage_has_a_layer():
    subpackages = sorted(p.name for p in (SRC / "poprun").iterdir()
                         if p.is_dir() and (p / "__init__.py").exists())
    unranked = [s for s in subpackages if s not in RANKS]
    assert not unranked, (f"poprun subpackages with no layer in tests/test_layout.py's RANKS "
                          f"(and docs/architecture.md, 'Layers and data flow'): {unranked}")
    gone = sorted(set(RANKS) - set(subpackages))
    assert not gone, f"RANKS names subpackages that do not exist: {gone}"


def test_imports_only_go_down_the_layers():
    climbing = []
    for imp in IMPORTS:
        if not in_poprun(imp.importer) or imp.importer in ENTRY_POINTS:
            continue
        if not in_poprun(imp.target):
            continue
        if imp.target == "poprun":
            climbing.append(f"{imp.where()}  [imports the entry point poprun/__init__.py "
                            f"(whose names reach run/): import the defining module instead]")
        elif rank(imp.target) > rank(imp.importer):
            climbing.append(
                f"{imp.where()}  [{layer(imp.importer)} (rank {rank(imp.importer)}) imports "
                f"{imp.target} in {layer(imp.target)} (rank {rank(imp.target)})"
                f"{', inside a function' if imp.lazy else ''}"
                f"{', under TYPE_CHECKING' if not imp.runtime else ''}]")
    assert not climbing, ("imports that climb the layers (cli > run > jobctl > view > plan > "
                          "leaves; docs/architecture.md, 'Layers and data flow'):\n  "
                          + "\n  ".join(climbing))


# ------------------------------------------------------------------------- (b) no cycles


def _packages_run_by(imp: Import) -> list[str]:
    """The packages whose __init__.py an import also runs: those on the target's dotted path
    that are not already being imported as the importer's own ancestors."""
    parts = imp.target.split(".")
    importer_parts = imp.importer.split(".")
    ancestors = {".".join(importer_parts[:i]) for i in range(1, len(importer_parts) + 1)}
    return [pkg for i in range(1, len(parts))
            if (pkg := ".".join(parts[:i])) in POPRUN_MODULES and pkg not in ancestors]


def import_graph(with_lazy: bool) -> dict[str, dict[str, Import]]:
    """importer -> {imported module: the first statement that imports it}, over poprun's
    modules, from the imports that run (never those under TYPE_CHECKING)."""
    graph: dict[str, dict[str, Import]] = {name: {} for name in POPRUN_MODULES}
    for imp in IMPORTS:
        if not (in_poprun(imp.importer) and imp.runtime and (with_lazy or not imp.lazy)):
            continue
        for target in [imp.target, *_packages_run_by(imp)]:
            if target in POPRUN_MODULES and target != imp.importer:
                graph[imp.importer].setdefault(target, imp)
    return graph


def find_cycles(graph: dict[str, dict[str, Import]]) -> list[list[str]]:
    """Cycles (lists of modules, the first repeated at the end): the shortest cycle of each
    strongly connected component, then, with that cycle's imports taken out, the shortest
    of what still forms one, until nothing does. So each reported cycle has an import that
    no other reported cycle has: one wrong import is reported once, not once per module it
    drags into the knot."""
    graph = {node: dict(children) for node, children in graph.items()}
    cycles = []
    while components := strongly_connected(graph):
        for component in components:
            members = set(component)
            cycle = min((_cycle_through(graph, node, members) for node in component),
                        key=len)
            cycles.append(cycle)
            for a, b in zip(cycle, cycle[1:]):
                del graph[a][b]
    return cycles


def strongly_connected(graph: dict[str, dict[str, Import]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm,
    iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        work = [(root, iter(sorted(graph[root])))]
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        components.append(sorted(component))
    return components


def _cycle_through(graph: dict[str, dict[str, Import]], start: str,
                   component: set[str]) -> list[str]:
    """A shortest cycle through `start` within its component (breadth-first)."""
    paths = {start: [start]}
    queue = [start]
    while queue:
        node = queue.pop(0)
        for child in sorted(graph[node]):
            if child not in component:
                continue
            if child == start:
                return paths[node] + [start]
            if child not in paths:
                paths[child] = paths[node] + [child]
                queue.append(child)
    raise AssertionError(f"no cycle through {start} in {sorted(component)}")


def describe_cycle(graph: dict[str, dict[str, Import]], cycle: list[str]) -> str:
    steps = []
    for a, b in zip(cycle, cycle[1:]):
        imp = graph[a][b]
        how = "" if imp.target == b else f" (runs {b}'s __init__.py)"
        steps.append(f"    {a} -> {b}{how}: {imp.where()}"
                     f"{'  [inside a function]' if imp.lazy else ''}")
    return " -> ".join(cycle) + "\n" + "\n".join(steps)


@pytest.mark.parametrize("with_lazy", [False, True], ids=["top-level", "with-lazy"])
def test_no_import_cycles(with_lazy):
    graph = import_graph(with_lazy)
    cycles = find_cycles(graph)
    kind = ("counting the imports inside functions too" if with_lazy
            else "among top-level imports")
    assert not cycles, (f"import cycles among poprun's modules, {kind}:\n"
                        + "\n".join(describe_cycle(graph, c) for c in cycles))


def test_cycle_finder_finds_planted_cycles():
    """The check above can fail: in a made-up graph with two cycles joined through a shared
    module, and a module that only leads into them, both cycles are reported and the
    bystander is on neither."""
    def imp(a: str, b: str) -> Import:
        return Import(a, b, SRC / "poprun/x.py", 1, False, True, f"planted {a} -> {b}")

    edges = {"a": ["b"], "b": ["c"], "c": ["a", "d"], "d": ["c"], "e": ["a"]}
    graph = {a: {b: imp(a, b) for b in bs} for a, bs in edges.items()}
    cycles = find_cycles(graph)
    assert sorted(map(tuple, cycles)) == [("a", "b", "c", "a"), ("c", "d", "c")], cycles
    assert "a -> b -> c -> a" in describe_cycle(graph, ["a", "b", "c", "a"])


# ------------------------------------------------------------------------- (c) the other packages


def test_spawner_and_popdist_import_only_the_version_of_poprun():
    bad = [imp.where() for imp in IMPORTS
           if not in_poprun(imp.importer) and in_poprun(imp.target)
           and imp.target != VERSION_MODULE]
    assert not bad, ("spawner and popdist may import nothing of poprun but poprun._version "
                     "(docs/architecture.md, 'Packages'):\n  " + "\n  ".join(bad))


# ------------------------------------------------------------------------- (d) the module map

HEADING = re.compile(r"^`(?P<name>[A-Za-z_][\w/]*?)/?`")
BULLET_NAMES = re.compile(r"^- (?P<names>`[\w.]+\.py`(?:, `[\w.]+\.py`)*):")
PATH = re.compile(r"`(?:src/)?(?P<path>poprun/[\w/]+\.py)`")


def module_map() -> tuple[dict[str, set[str]], set[str]]:
    """From docs/architecture.md's "Module map": {heading dir: names listed under it}, and
    every `poprun/....py` path written anywhere in the section."""
    text = DOC.read_text(encoding="utf-8")
    match = re.search(r"^## Module map\n(?P<body>.*?)(?=^## )", text, re.M | re.S)
    assert match, "docs/architecture.md has no '## Module map' section"
    body = match["body"]
    listed: dict[str, set[str]] = {}
    heading = None
    for line in body.splitlines():
        if (h := HEADING.match(line)) is not None:
            heading = h["name"]
            listed.setdefault(heading, set())
        elif (b := BULLET_NAMES.match(line)) is not None:
            assert heading is not None, f"module map: a bullet before any heading: {line!r}"
            listed[heading].update(re.findall(r"`([\w.]+\.py)`", b["names"]))
    return listed, {m["path"] for m in PATH.finditer(body)}


def poprun_files() -> set[str]:
    return {str(path.relative_to(SRC)) for path in POPRUN_MODULES.values()}


def test_module_map_names_every_module():
    listed, paths = module_map()
    named = set(paths)
    for heading, names in listed.items():
        named.update(f"{heading}/{n}" for n in names)
        named.add(f"{heading}/__init__.py")  # a subpackage's heading names its __init__.py
    missing = sorted(poprun_files() - named)
    assert not missing, ("modules that docs/architecture.md's 'Module map' does not name "
                         "(as `name.py` under its subpackage's heading, or by path):\n  "
                         + "\n  ".join(f"src/{m}" for m in missing))


def test_module_map_names_only_modules_that_exist():
    listed, _ = module_map()
    documented = {f"{heading}/{n}" for heading, names in listed.items()
                  if heading == "poprun" or heading.startswith("poprun/") for n in names}
    headings = {h for h in listed if h.startswith("poprun/")}
    stale = sorted((documented - poprun_files())
                   | {f"{h}/" for h in headings if not (SRC / h / "__init__.py").exists()})
    assert not stale, ("docs/architecture.md's 'Module map' names modules that are not in "
                       "src/:\n  " + "\n  ".join(stale))


# ------------------------------------------------------------------------- (e) no tracker citations

# "issue" and its number, or "issues" and theirs; spelt in pieces so this file does not match.
CITATION = re.compile(r"\b" + "iss" + r"ues?\s+#?\d+\b", re.I)


def cited_issues() -> list[str]:
    """`file:line: text` for every citation of a tracker issue where the code is read."""
    files = [DOC, *(path for top in (SRC, ROOT / "tests") for path in sorted(top.rglob("*"))
                    if path.is_file() and "__pycache__" not in path.parts
                    and not any(p.endswith(".egg-info") for p in path.parts))]
    found = []
    for path in files:
        text = path.read_bytes().decode("utf-8", errors="replace")
        for match in CITATION.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            found.append(f"{path.relative_to(ROOT)}:{line}: {text.splitlines()[line - 1].strip()}")
    return found


def test_no_file_cites_a_tracker_issue():
    cited = cited_issues()
    assert not cited, ("tracker issues cited by number (say the behaviour, or the defect it "
                       "guards against, instead):\n  " + "\n  ".join(cited))
