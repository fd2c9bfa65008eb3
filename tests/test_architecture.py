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
RUNTIME = {p.stem for p in (ROOT / "core").glob("*.py")} - FACADE - {KIT}
TOOLS = {p.stem for p in (ROOT / "core" / "tools").glob("*.py")} - {"__init__"}


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
    for name in sorted(RUNTIME):
        for module in _imports(ROOT / "core" / f"{name}.py", ""):
            head = module.split(".")[0]
            assert head not in ("tools", KIT), f"core/{name}.py imports gradseam.{module} (a tool or the kit)"


def test_patching_a_model_loads_no_tool():
    code = (
        "import sys, gradseam\n"
        "from gradseam import patcher, offload, strategies, planning, registry, loading, summary\n"
        "print(sorted(m for m in sys.modules if m.startswith('gradseam.tools') or m == 'gradseam.testing'))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


def test_no_module_imports_private_names_of_another():
    paths = [(p, "") for p in (ROOT / "core").glob("*.py")] + [(p, "tools") for p in (ROOT / "core" / "tools").glob("*.py")]
    paths += [(p, "adapters") for p in (ROOT / "adapters").glob("*.py")]
    for path, package in sorted(paths):
        for module in _imports(path, package):
            name = module.rsplit(".", 1)[-1]
            assert not (name.startswith("_") and not name.startswith("__")), (
                f"{path.relative_to(ROOT)} imports private {module}"
            )
