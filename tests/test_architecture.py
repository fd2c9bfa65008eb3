"""The layout is the architecture: the runtime that patches models stands alone.

The runtime (what ``gradseam.patch`` needs, the modules directly in ``core/``) must not import the
tools that measure and advise (``core/tools/``, ``gradseam.tools``) nor the conformance kit
(``gradseam.testing``), so that patching a model pulls in none of them and a tool can change
without touching what runs inside a training step. And no module reaches into another's private
names: what one module offers another is public, named, and documented where it is defined.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KIT = "testing"
FACADE = {"__init__", "__main__"}  # the package's entry points may name a tool (gradseam.advise, the CLI)
SUBPACKAGES = ("run", "offload", "kinds")  # the run layer, the offload engine, the region kinds
RUNTIME = ({p.stem for p in (ROOT / "core").glob("*.py")} - FACADE - {KIT}) | set(SUBPACKAGES)
TOOLS = {p.stem for p in (ROOT / "core" / "tools").glob("*.py")} - {"__init__"}

# The runtime's layers, lowest first: a module imports only from its own layer or below, so the
# arrows run one way (contract -> config and catalog -> plan -> run -> engine; the API on top).
# The engine sits at the bottom: it knows nothing of families, configs or plans.
LAYERS: dict[str, int] = {
    "offload": 0,
    "errors": 1, "family": 1, "hookspecs": 1, "inputs": 1, "modules": 1,
    "backends": 2, "config": 2, "registry": 2,
    "kinds": 3, "planning": 3, "plan_search": 3, "spec": 3,
    "run": 4,
    "summary": 5, "auto": 5, "handle": 5, "patcher": 5, "loading": 5,
}


def _runtime_files() -> list[tuple[Path, str]]:
    """(file, its package relative to gradseam) for every runtime module, subpackages included."""
    files = [(p, "") for p in (ROOT / "core").glob("*.py") if p.stem not in FACADE | {KIT}]
    for sub in SUBPACKAGES:
        files += [(p, sub) for p in (ROOT / "core" / sub).glob("*.py")]
    return sorted(files)


def _layer_of(path: Path, package: str) -> str:
    return package or path.stem


def _imports(path: Path, package: str) -> list[str]:
    """Every gradseam module ``path`` imports (dotted, relative to gradseam), nested imports included.

    ``package`` is the file's package relative to gradseam ("" for core/, "tools" for core/tools/),
    to resolve relative imports; ``from x import name`` yields ``x.name`` too, since ``name`` may be
    a submodule.
    """
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".") if package else []
                base = parts[: len(parts) - (node.level - 1)]
                module = ".".join([*base, *([node.module] if node.module else [])])
            elif node.module == "gradseam" or (node.module or "").startswith("gradseam."):
                module = node.module.removeprefix("gradseam").lstrip(".")
            else:
                continue
            found.append(module)
            found += [f"{module}.{a.name}".lstrip(".") for a in node.names]
        elif isinstance(node, ast.Import):
            found += [a.name.removeprefix("gradseam").lstrip(".") for a in node.names
                      if a.name == "gradseam" or a.name.startswith("gradseam.")]
    return found


def test_runtime_and_tools_are_apart_on_disk():
    assert RUNTIME and TOOLS
    assert not RUNTIME & TOOLS, sorted(RUNTIME & TOOLS)
    assert {"bench", "advise", "demo", "cli", "workloads", "synthetic", "measure"} <= TOOLS


def test_the_runtime_imports_no_tool_and_not_the_kit():
    for path, package in _runtime_files():
        for module in _imports(path, package):
            head = module.split(".")[0]
            assert head not in ("tools", KIT), f"{path.relative_to(ROOT)} imports gradseam.{module} (a tool or the kit)"


def test_every_runtime_module_has_a_layer():
    assert {_layer_of(p, pkg) for p, pkg in _runtime_files()} == set(LAYERS)


def test_the_runtime_imports_only_downwards():
    """Config and the catalog import no execution module, the plan imports no run layer, the engine
    imports nothing of gradseam: every import goes to the module's own layer or one below it."""
    for path, package in _runtime_files():
        own = LAYERS[_layer_of(path, package)]
        for module in _imports(path, package):
            head = module.split(".")[0]
            if head in LAYERS:
                assert LAYERS[head] <= own, (
                    f"{path.relative_to(ROOT)} (layer {own}) imports gradseam.{module} (layer {LAYERS[head]}): "
                    "arrows must run one way"
                )


def test_no_import_circle_between_runtime_modules():
    graph: dict[str, set[str]] = {}
    for path, package in _runtime_files():
        name = ".".join(p for p in (package, path.stem) if p and p != "__init__") or path.stem
        known = {".".join(x for x in (pkg, q.stem) if x and x != "__init__") for q, pkg in _runtime_files()}
        graph[name] = {m for m in _imports(path, package) if m in known and m != name}
    seen: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> None:
        if seen.get(node) == 1:
            raise AssertionError(f"import circle: {' -> '.join([*trail[trail.index(node):], node])}")
        if seen.get(node) == 2:
            return
        seen[node] = 1
        for nxt in sorted(graph.get(node, ())):
            visit(nxt, [*trail, node])
        seen[node] = 2

    for node in sorted(graph):
        visit(node, [])


def test_patching_a_model_loads_no_tool():
    code = (
        "import sys, gradseam\n"
        "from gradseam import patcher, offload, planning, registry, loading, summary\n"
        "from gradseam.run import chains, install, kernels, scopes\n"
        "print(sorted(m for m in sys.modules if m.startswith('gradseam.tools') or m == 'gradseam.testing'))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


def test_no_module_imports_private_names_of_another():
    paths = [(p, "") for p in (ROOT / "core").glob("*.py")] + [(p, "tools") for p in (ROOT / "core" / "tools").glob("*.py")]
    paths += [(p, sub) for sub in SUBPACKAGES for p in (ROOT / "core" / sub).glob("*.py")]
    paths += [(p, "adapters") for p in (ROOT / "adapters").glob("*.py")]
    for path, package in sorted(paths):
        for module in _imports(path, package):
            name = module.rsplit(".", 1)[-1]
            assert not (name.startswith("_") and not name.startswith("__")), (
                f"{path.relative_to(ROOT)} imports private {module}"
            )


# -- one home per kind ----------------------------------------------------------------------------
#
# A region kind (gradseam.kinds) owns its behaviour: only its own module, the catalog, the kinds'
# registry and its runner may name it. Everything else asks the kind (``spec.kind.compiles``,
# ``kind.describe(...)``) or the catalog's data (``backend.moves``), so that a new backend is one
# catalog entry, a kind if its behaviour is new, a runner if it installs differently.

SHARED = {"core/backends.py", "core/kinds/__init__.py", "core/kinds/base.py", "core/run/install.py"}
CHECKPOINT_RUNNER = {"core/run/chains.py", "core/run/links.py", "core/run/scopes.py", "core/run/kernels.py",
                     "core/run/seams.py"}
HOMES = {  # kind name -> the modules of the kind and its runner
    "whole-block": {"core/kinds/block.py", *CHECKPOINT_RUNNER},
    "ffn-seam": {"core/kinds/ffn.py", *CHECKPOINT_RUNNER},
    "compiled-block": {"core/kinds/compiled.py", "core/run/compiled.py", "core/run/compiler.py", "core/run/unused.py"},
    "attention-offload": {"core/kinds/attention.py", "core/run/scopes.py", "core/planning.py"},
}
# "torch" names a package as often as a backend: it is left out of the words searched for.
PACKAGE_NAMES = {"torch"}


def _names_of_kinds() -> dict[str, set[str]]:
    from gradseam.backends import CATALOG
    from gradseam.kinds import KINDS

    names: dict[str, tuple[set[str], set[str]]] = {}  # kind -> (its strings, its identifiers)
    for name, kind in KINDS.items():
        strings = {name} | ({b.name for b in CATALOG.values() if b.kind == name} - PACKAGE_NAMES)
        names[name] = (strings, {type(kind).__name__, kind._global})
    return names


def _docstrings(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def _words(path: Path) -> tuple[set[str], set[str]]:
    """The exact string constants (docstrings left out) and the identifiers a module uses."""
    tree = ast.parse(path.read_text())
    skip = _docstrings(tree)
    strings: set[str] = set()
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            strings.add(node.value)
        elif isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.alias):
            names.add(node.name.rsplit(".", 1)[-1])
    return strings, names


def test_only_a_kinds_home_names_it():
    """No module of the package (runtime, tools, kit) outside a kind's own module, the catalog, the kinds'
    registry and the kind's runner names a kind or one of its backends: it would be branching on it."""
    names = _names_of_kinds()
    assert set(names) == set(HOMES), "every kind needs its homes declared here"
    offenders = []
    for path in sorted((ROOT / "core").rglob("*.py")):
        where = str(path.relative_to(ROOT))
        strings, identifiers = _words(path)
        for kind, (kind_strings, kind_identifiers) in names.items():
            if where in SHARED or where in HOMES[kind]:
                continue
            hits = sorted((strings & kind_strings) | (identifiers & kind_identifiers))
            if hits:
                offenders.append(f"{where} names kind {kind!r}: {hits}")
    assert not offenders, "\n".join(offenders)
