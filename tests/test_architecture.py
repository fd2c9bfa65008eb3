"""The layout is the architecture: the runtime that patches models stands alone.

The runtime (what ``gradseam.patch`` needs) must not import the tools that measure and advise, nor
the conformance kit, so that patching a model pulls in none of them and a tool can change without
touching what runs inside a training step. And no module reaches into another's private names:
what one module offers another is public, named, and documented where it is defined.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUNTIME = {"backends", "config", "errors", "family", "hookspecs", "kernels", "links", "loading", "offload",
           "patcher", "pinned", "planning", "registry", "scopes", "seams", "strategies", "summary"}
TOOLS_AND_KIT = {"advise", "bench", "cli", "cli_support", "demo", "launch", "launch_report", "named_strategies",
                 "synthetic", "testing", "workloads"}


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    """(module imported relative to gradseam, names) for every import in the file, nested ones included."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level == 1:
                found.append((module, [a.name for a in node.names]))
            elif module == "gradseam" or module.startswith("gradseam."):
                found.append((module.removeprefix("gradseam").lstrip("."), [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            found += [(a.name.removeprefix("gradseam").lstrip("."), []) for a in node.names
                      if a.name == "gradseam" or a.name.startswith("gradseam.")]
    return found


def test_every_core_module_is_classified():
    modules = {p.stem for p in (ROOT / "core").glob("*.py")} - {"__init__", "__main__"}
    assert modules == RUNTIME | TOOLS_AND_KIT, sorted(modules ^ (RUNTIME | TOOLS_AND_KIT))


def test_the_runtime_imports_no_tool_and_not_the_kit():
    for name in sorted(RUNTIME):
        for module, names in _imports(ROOT / "core" / f"{name}.py"):
            targets = {module.split(".")[0]} if module else set(names)
            assert not targets & TOOLS_AND_KIT, f"core/{name}.py imports {module or names} (a tool or the kit)"


def test_no_module_imports_private_names_of_another():
    for path in sorted([*(ROOT / "core").glob("*.py"), *(ROOT / "adapters").glob("*.py")]):
        for module, names in _imports(path):
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            assert not private, f"{path.relative_to(ROOT)} imports private {private} from {module or '.'}"
