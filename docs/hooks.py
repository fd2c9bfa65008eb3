"""mkdocs hooks: find gradseam's sources for the API reference, and snippets from any directory.

The import package ``gradseam`` lives in ``core/`` (and ``gradseam.adapters`` in ``adapters/``).
griffe, which mkdocstrings uses, finds packages by directory name, so neither a source checkout
nor an editable install shows it a ``gradseam`` directory; and falling back to importing would run
``gradseam.__main__`` (the CLI). This hook lays the sources out under their import names in a
temporary directory, points mkdocstrings there, and removes the directory after the build. In
that copy, the Sphinx roles the docstrings use (``:class:`X```) become Markdown code spans and
``Example::`` loses its reST literal-block marker, since the site renders docstrings as Markdown.

Snippets (``--8<--``, used to show the example plugin's files) are resolved from the repository
root, so ``mkdocs build -f path/to/mkdocs.yml`` works from anywhere.
"""

from __future__ import annotations

import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

from mkdocs.plugins import event_priority

ROOT = Path(__file__).resolve().parents[1]
_made: list[Path] = []
_ROLE = re.compile(r":(?:class|func|meth|attr|data|mod|exc|obj):`~?([^`]+)`")
_LITERAL = re.compile(r"^(\s*\S.*\w)::$", re.MULTILINE)


def _markdown_docstrings(package: Path) -> None:
    for path in package.rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        path.write_text(_LITERAL.sub(r"\1:", _ROLE.sub(r"`\1`", text)), encoding="utf-8")


@event_priority(100)  # before mkdocstrings, which creates its handlers in its own on_config
def on_config(config: Any) -> Any:
    tmp = Path(tempfile.mkdtemp(prefix="gradseam-api-"))
    _made.append(tmp)
    skip = shutil.ignore_patterns("__pycache__", "__main__.py")
    shutil.copytree(ROOT / "core", tmp / "gradseam", ignore=skip)
    shutil.copytree(ROOT / "adapters", tmp / "gradseam" / "adapters", ignore=skip)
    _markdown_docstrings(tmp / "gradseam")
    python = config.plugins["mkdocstrings"].config.handlers.setdefault("python", {})
    python["paths"] = [str(tmp)]
    config.mdx_configs.setdefault("pymdownx.snippets", {})["base_path"] = [str(ROOT)]
    return config


def _clean(*_: Any, **__: Any) -> None:
    while _made:
        shutil.rmtree(_made.pop(), ignore_errors=True)


on_post_build = _clean
on_build_error = _clean
