"""diffusers' own model tests, run with every model of a gradseam family patched the moment it is built.

``python docs/scripts/upstream_tests.py --tests DIFFUSERS/tests --json upstream-tests.json [--config NAME]
[FILE_PATTERN ...]`` runs each of diffusers' transformer model test files (``tests/models/transformers``
of a diffusers checkout, against the installed diffusers) once unpatched and once per gradseam config,
in a fresh pytest process each, and reports every test whose outcome the patch changes.

Why this exists: the conformance kit checks what gradseam promises (exact outputs and gradients on
tiny models); diffusers' suites check what diffusers promises about its models (save/load round
trips, ``state_dict`` keys, dtype and device moves, attention processors, PEFT adapters, caching,
gradient checkpointing, hooks). A patched model must keep every one of those promises, or refuse
the call with an error naming the cause. The patch is applied inside the model class's constructor
(after the outermost ``__init__`` returns), so every model a test builds, reloads or copies is the
patched one, exactly as under ``gradseam run`` with load-time patching. Offloading configs run in
``gradseam.offload.cpu_test_mode`` (every offloaded byte through host buffers, as on a GPU).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

CONFIGS: dict[str, dict[str, Any] | None] = {
    "unpatched": None,
    "torch": {"gradient_checkpointing": True},
    "torch-ffn": {"gradient_checkpointing": True, "gradient_checkpointing_backend": "torch-ffn"},
    "torch, interval 2": {"gradient_checkpointing": True, "gradient_checkpointing_interval": 2},
    "torch + attention kept": {"gradient_checkpointing": True, "gradient_checkpointing_keep_attention": True},
    "unsloth + attention offload": {"gradient_checkpointing": True, "gradient_checkpointing_backend": "unsloth",
                                    "gradient_checkpointing_offload_attention": True},
    "compile": {"gradient_checkpointing": True, "gradient_checkpointing_backend": "compile"},
}


class PatchOnBuild:
    """A pytest plugin: every model of a family's classes comes out of its constructor patched."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.outcomes: dict[str, dict[str, str]] = {}
        self._restore: list[tuple[type, Any]] = []
        self._depth = threading.local()

    def pytest_sessionstart(self, session: Any) -> None:
        import warnings

        from gradseam.registry import REGISTRY
        from gradseam.tools.checks import model_class

        warnings.filterwarnings("ignore", message="gradseam")
        for family in REGISTRY.families():
            try:
                cls = model_class(family)
            except Exception:
                continue
            self._restore.append((cls, cls.__dict__["__init__"]))
            cls.__init__ = self._wrap(cls.__dict__["__init__"])

    def _wrap(self, init: Any) -> Any:
        plugin = self

        @functools.wraps(init)
        def patched_init(model: Any, *args: Any, **kwargs: Any) -> None:
            depth = getattr(plugin._depth, "n", 0)
            plugin._depth.n = depth + 1
            try:
                init(model, *args, **kwargs)
            finally:
                plugin._depth.n = depth
            if depth == 0:
                import gradseam

                gradseam.patch(model, plugin.config)

        return patched_init

    def pytest_sessionfinish(self, session: Any) -> None:
        for cls, init in self._restore:
            cls.__init__ = init

    def pytest_runtest_logreport(self, report: Any) -> None:
        """One outcome per test: failed if any phase failed, else skipped if one skipped, else passed."""
        if report.when != "call" and report.outcome == "passed":
            return
        row = self.outcomes.setdefault(report.nodeid, {"outcome": "passed"})
        if row["outcome"] != "failed" and report.outcome != "passed":
            row["outcome"] = report.outcome
            if report.outcome == "failed":
                row["error"] = _first_error(report)


def _first_error(report: Any) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    text = f"{crash.message} ({Path(crash.path).name}:{crash.lineno})" if crash is not None else str(report.longrepr)
    return " ".join(text.split())[:400]


def run_one(files: list[str], config_name: str, out: Path) -> None:
    """In this process: pytest over ``files`` with ``config_name`` applied; outcomes to ``out``."""
    import pytest

    config = CONFIGS[config_name]
    plugins: list[Any] = []
    outcomes: dict[str, dict[str, str]] = {}
    if config is None:
        class Record(PatchOnBuild):
            def pytest_sessionstart(self, session: Any) -> None:
                pass

        plugin: PatchOnBuild = Record({})
    else:
        plugin = PatchOnBuild(config)
    plugins.append(plugin)
    args = ["-q", "-p", "no:cacheprovider", "-x" if os.environ.get("UPSTREAM_FAIL_FAST") else "-q", *files]
    if config is not None and config.get("gradient_checkpointing_backend", "torch").startswith("unsloth"):
        from gradseam.offload import cpu_test_mode

        with cpu_test_mode():
            pytest.main(args, plugins=plugins)
    else:
        pytest.main(args, plugins=plugins)
    outcomes = plugin.outcomes
    out.write_text(json.dumps(outcomes, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tests", type=Path, required=True, help="a diffusers checkout's tests/ folder")
    parser.add_argument("--config", action="append", choices=[c for c in CONFIGS if c != "unpatched"],
                        help="gradseam configs to run (default: all but compile)")
    parser.add_argument("--json", type=Path, default=Path("upstream-tests.json"))
    parser.add_argument("--one", nargs=3, metavar=("FILES", "CONFIG", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("patterns", nargs="*", default=["test_models_transformer_*.py"],
                        help="test files under tests/models/transformers (glob patterns)")
    args = parser.parse_args()
    if args.one:
        files, config, out = args.one
        run_one(files.split(","), config, Path(out))
        return
    folder = args.tests / "models" / "transformers"
    files = sorted({str(p) for pattern in args.patterns for p in folder.glob(pattern)})
    configs = ["unpatched", *(args.config or [c for c in CONFIGS if c not in ("unpatched", "compile")])]
    results: dict[str, Any] = {"files": [Path(f).name for f in files], "configs": {}}
    for name in configs:
        out = args.json.with_suffix(f".{name.replace(' ', '_').replace(',', '').replace('+', 'and')}.json")
        print(f"[{configs.index(name) + 1}/{len(configs)}] {name}: {len(files)} files", flush=True)
        subprocess.run([sys.executable, __file__, "--tests", str(args.tests), "--one", ",".join(files), name,
                        str(out)], cwd=args.tests.parent, check=False,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        results["configs"][name] = json.loads(out.read_text())
        out.unlink()
    base = results["configs"]["unpatched"]
    changed: dict[str, dict[str, Any]] = {}
    for name in configs[1:]:
        for test, row in results["configs"][name].items():
            was = base.get(test, {}).get("outcome")
            if row["outcome"] != was:
                changed.setdefault(test, {})[name] = {"was": was, **row}
    results["changed"] = changed
    counts = {name: _count(rows) for name, rows in results["configs"].items()}
    results["counts"] = counts
    args.json.write_text(json.dumps(results, indent=1))
    for name, c in counts.items():
        print(f"{name:32} {c}")
    print(f"{len(changed)} tests change outcome under some config; written {args.json}")


def _count(rows: dict[str, dict[str, str]]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for row in rows.values():
        counts[row["outcome"]] = counts.get(row["outcome"], 0) + 1
    return counts


if __name__ == "__main__":
    main()
