"""The package layering (docs/design.md "Layering"): no import circle among teratron's modules,
and no package imports a package above it.

Every `import` / `from ... import` of a teratron module counts, at module level or inside a
function: a function-local import that goes upward or closes a circle is still a violation.
The code is read with `ast`, never imported.
"""

import ast
import pathlib
from typing import Dict, List, Optional, Tuple

PACKAGE_DIR = pathlib.Path(__file__).resolve().parent.parent / "teratron"

# Bottom to top; the same table as docs/design.md "Layering". A unit is a subpackage or a
# top-level module of teratron ("teratron" is the package's own __init__). A unit may import its
# own modules and units of LOWER levels only; units of one level are independent of each other.
LAYERS = [
    ("parent_death",),
    ("teratron", "utils", "model_parallel_config", "fusions", "packed_seq_params"),
    ("topology",),
    ("parallel_state", "process_groups"),
    ("comm",),
    ("fp8", "pipeline_parallel"),
    ("tensor_parallel",),
    ("transformer",),
    ("ssm",),
    ("models",),
    ("distributed", "optimizer", "optimizer_param_scheduler"),
    ("dist_checkpointing", "tokenizers"),
    ("datasets", "inference"),
    ("training",),
    ("convert", "estimate"),
    ("bench",),
    ("cli",),
    ("__main__",),
]

# (importing module, imported module) -> why this upward import is right by design. Keep it empty
# or nearly so: an upward import is almost always code in the wrong place.
ALLOWED_UPWARD: Dict[Tuple[str, str], str] = {}

Edge = Tuple[str, str]  # (importer, imported), dotted module names


def find_modules(package_dir: pathlib.Path) -> Dict[str, pathlib.Path]:
    """Dotted module name -> file, for every .py under `package_dir` (a package is its __init__)."""
    modules = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(package_dir.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _imported_names(node, module: str, is_package: bool) -> List[str]:
    """The dotted names an import statement asks for; `from a import b` asks for a.b, which is
    a submodule or else a name in a."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:  # relative: '.' is the importer's package
        anchor = module.split(".")
        anchor = anchor[:len(anchor) - node.level + (1 if is_package else 0)]
        base = ".".join(anchor + ([node.module] if node.module else []))
    return [f"{base}.{alias.name}" for alias in node.names]


def _resolve(name: str, modules) -> Optional[str]:
    """The module a dotted name lives in: its longest prefix that is a module."""
    parts = name.split(".")
    while parts and ".".join(parts) not in modules:
        parts.pop()
    return ".".join(parts) or None


def import_edges(package_dir: pathlib.Path) -> Dict[Edge, str]:
    """(importer, imported) -> 'file:line' of the first import statement that makes the edge."""
    modules = find_modules(package_dir)
    edges = {}
    for module, path in modules.items():
        is_package = path.name == "__init__.py"
        tree = ast.parse(path.read_text(), filename=str(path))
        imports = [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))]
        for node in sorted(imports, key=lambda node: node.lineno):
            names = _imported_names(node, module, is_package)
            for target in {_resolve(n, modules) for n in names} - {None, module}:
                edges.setdefault((module, target), f"{path.relative_to(package_dir.parent)}:{node.lineno}")
    return edges


def with_package_inits(edges: Dict[Edge, str], modules) -> Dict[Edge, str]:
    """Add the imports Python makes implicitly: importing a.b.c runs a/__init__.py and
    a/b/__init__.py first, unless the importer is that package or inside it (its __init__ already
    runs)."""
    out = dict(edges)
    for (importer, target), where in edges.items():
        parts = target.split(".")
        for i in range(2, len(parts)):
            parent = ".".join(parts[:i])
            if parent in modules and not (importer + ".").startswith(parent + "."):
                out.setdefault((importer, parent), f"{where} (runs {parent}.__init__)")
    return out


def find_cycles(edges: Dict[Edge, str]) -> List[List[str]]:
    """One circle per strongly connected component of the graph: [m0, m1, ..., m0]."""
    graph: Dict[str, List[str]] = {}
    for importer, target in sorted(edges):
        graph.setdefault(importer, []).append(target)
        graph.setdefault(target, [])
    index, low, stack, on_stack, components = {}, {}, [], set(), []

    def visit(node):  # Tarjan
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = set()
            while node not in component:
                component.add(stack.pop())
            on_stack.difference_update(component)
            if len(component) > 1:
                components.append(component)

    for node in graph:
        if node not in index:
            visit(node)
    return [_circle_in(component, graph) for component in components]


def _circle_in(component, graph) -> List[str]:
    """A shortest circle through the component's smallest module (breadth-first)."""
    start = min(component)
    came_from = {start: None}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for nxt in graph[node]:
                if nxt == start:
                    path = [node]  # back to start
                    while came_from[path[-1]] is not None:
                        path.append(came_from[path[-1]])
                    return path[::-1] + [start]
                if nxt in component and nxt not in came_from:
                    came_from[nxt] = node
                    following.append(nxt)
        frontier = following
    raise AssertionError(f"no circle through {start}")


def unit_of(module: str) -> str:
    """teratron.transformer.moe.router -> 'transformer'; teratron -> 'teratron'."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def upward_imports(edges: Dict[Edge, str], layers, allowed) -> List[str]:
    """One line per import of a unit that is not below the importer's: 'file:line: importer
    imports target (target's unit and level, the importer's unit and level)'."""
    level = {unit: i for i, units in enumerate(layers) for unit in units}
    found = []
    for (importer, target), where in sorted(edges.items()):
        low, high = unit_of(importer), unit_of(target)
        if low != high and level[high] >= level[low] and (importer, target) not in allowed:
            found.append(f"{where}: {importer} imports {target} ({high!r}, level {level[high]}, is not "
                         f"below {low!r}, level {level[low]})")
    return found


def _format_cycle(circle, edges) -> str:
    steps = [f"  {a} -> {b}   [{edges[(a, b)]}]" for a, b in zip(circle, circle[1:])]
    return " -> ".join(circle) + "\n" + "\n".join(steps)


# ----- the checks on teratron ------------------------------------------------------------------

def test_every_unit_has_one_level():
    placed = [unit for units in LAYERS for unit in units]
    assert len(placed) == len(set(placed)), "a unit is listed twice in LAYERS"
    present = {unit_of(m) for m in find_modules(PACKAGE_DIR)}
    assert present - set(placed) == set(), "place these in LAYERS (and docs/design.md 'Layering')"
    assert set(placed) - present == set(), "LAYERS lists units that no longer exist; remove them"


def test_no_import_circle():
    edges = with_package_inits(import_edges(PACKAGE_DIR), find_modules(PACKAGE_DIR))
    cycles = find_cycles(edges)
    assert not cycles, "import circles:\n" + "\n".join(_format_cycle(c, edges) for c in cycles)


def test_no_package_imports_one_above_it():
    found = upward_imports(import_edges(PACKAGE_DIR), LAYERS, ALLOWED_UPWARD)
    assert not found, "imports against the layering (docs/design.md 'Layering'):\n" + "\n".join(found)


def test_allowed_upward_imports_still_exist():
    edges = import_edges(PACKAGE_DIR)
    stale = [edge for edge in ALLOWED_UPWARD if edge not in edges]
    assert not stale, f"ALLOWED_UPWARD lists imports the code no longer makes: {stale}; remove them"


# ----- the checker itself, on a small made-up package ---------------------------------------------

def _write(root: pathlib.Path, files: Dict[str, str]) -> pathlib.Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "pkg"


def test_checker_finds_function_local_and_relative_imports(tmp_path):
    package = _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/low/__init__.py": "from pkg.low.a import f\n",
        "pkg/low/a.py": "def f():\n    from ..high import b\n    return b\n",
        "pkg/high/__init__.py": "",
        "pkg/high/b.py": "from pkg.low import a\nimport pkg.util\n",
        "pkg/util.py": "",
    })
    edges = import_edges(package)
    assert set(edges) == {("pkg.low", "pkg.low.a"), ("pkg.low.a", "pkg.high.b"),
                          ("pkg.high.b", "pkg.low.a"), ("pkg.high.b", "pkg.util")}
    assert edges[("pkg.low.a", "pkg.high.b")] == "pkg/low/a.py:2"
    layers = [("pkg", "util"), ("low",), ("high",)]
    assert upward_imports(edges, layers, {}) == [
        "pkg/low/a.py:2: pkg.low.a imports pkg.high.b ('high', level 2, is not below 'low', level 1)"]
    assert upward_imports(edges, layers, {("pkg.low.a", "pkg.high.b"): "a registry"}) == []
    assert find_cycles(edges) == [["pkg.high.b", "pkg.low.a", "pkg.high.b"]]


def test_checker_counts_the_package_init_an_import_runs(tmp_path):
    # a.x imports b.y, which runs b/__init__.py, which imports a.x: a circle through an __init__.
    package = _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a/__init__.py": "",
        "pkg/a/x.py": "from pkg.b.y import g\n",
        "pkg/b/__init__.py": "from pkg.a import x\nfrom pkg.b import z\n",
        "pkg/b/y.py": "from pkg.b import z\n",
        "pkg/b/z.py": "",
    })
    edges = import_edges(package)
    assert find_cycles(edges) == []
    edges = with_package_inits(edges, find_modules(package))
    assert find_cycles(edges) == [["pkg.a.x", "pkg.b", "pkg.a.x"]]
    assert edges[("pkg.a.x", "pkg.b")] == "pkg/a/x.py:1 (runs pkg.b.__init__)"
    # Inside b (its __init__ included), importing b.z does not run b/__init__.py again.
    assert ("pkg.b.y", "pkg.b") not in edges and ("pkg.b", "pkg.b") not in edges


def test_layers_table_matches_the_design_doc():
    design = (PACKAGE_DIR.parent / "docs" / "design.md").read_text()
    section = design.split("\n## Layering\n", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|") for line in section.splitlines() if line[:3].strip("| ").isdigit()]
    assert [int(row[1]) for row in rows] == list(range(len(LAYERS))), "levels 0, 1, ... in order"
    for row, units in zip(rows, LAYERS):
        assert sorted(u.strip(" `") for u in row[2].split(",")) == sorted(units), "|".join(row)
