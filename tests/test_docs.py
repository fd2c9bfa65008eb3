"""The docs site builds offline with ``mkdocs build --strict``, its examples run, and it covers
every config key, hook and built-in family."""

from __future__ import annotations

import html
import importlib.util
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import gradseam
from gradseam import hookspecs
from gradseam.config import CheckpointConfig
from gradseam.errors import PLUGIN_GUIDE

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
DOCTEST_PAGES = sorted(p.name for p in DOCS.glob("*.md") if ">>> " in p.read_text(encoding="utf-8"))


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "GRADSEAM_PLUGINS"}
    env.update(OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1")
    return env


def _text(html_file: Path) -> str:
    """A built page's text, without markup (code blocks are split into highlighting spans)."""
    return html.unescape(re.sub(r"<[^>]+>", "", html_file.read_text(encoding="utf-8")))


def _headings(page: str) -> list[str]:
    text = (DOCS / page).read_text(encoding="utf-8")
    return [m.group(1).strip() for m in re.finditer(r"^#{1,6} (.+)$", text, re.MULTILINE)]


def test_mkdocs_build_strict(tmp_path):
    missing = [m for m in ("mkdocs", "mkdocstrings", "mkdocstrings_handlers.python") if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"the docs extra is not installed (no {', '.join(missing)}); pip install -e '.[docs]'")
    site = tmp_path / "site"
    out = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"), "-d", str(site)],
        capture_output=True, text=True, cwd=tmp_path, env=_env(), timeout=300,
    )
    assert out.returncode == 0, f"mkdocs build --strict failed:\n{out.stdout}\n{out.stderr}"
    for page in ("index.html", "getting-started/index.html", "options/index.html", "strategies/index.html",
                 "families/index.html", "plugins/index.html", "api/index.html", "benchmarks/index.html",
                 "contributing/index.html"):
        assert (site / page).is_file(), f"{page} missing from the built site"
    api = _text(site / "api" / "index.html")
    for name in ("gradseam.patch", "CheckpointConfig", "register_families", "ConformanceSuite", "check_strategy"):
        assert name in api, f"the API reference lacks {name}"
    assert ":class:" not in api, "a Sphinx role leaked into the API reference"
    plugins = _text(site / "plugins" / "index.html")
    assert "register(PIXART)" in plugins and "class TestPixArt(ConformanceSuite)" in plugins, "snippets not included"
    contributing = _text(site / "contributing" / "index.html")
    assert "Code style" in contributing, "CONTRIBUTING.md not included"


@pytest.mark.parametrize("page", DOCTEST_PAGES)
def test_page_examples_run(page):
    """Every ``>>>`` example on the page, as a doctest in a fresh interpreter: the output shown is real."""
    out = subprocess.run(
        [sys.executable, "-m", "doctest", "-o", "ELLIPSIS", "-o", "NORMALIZE_WHITESPACE", str(DOCS / page)],
        capture_output=True, text=True, cwd=ROOT, env=_env(), timeout=300,
    )
    assert out.returncode == 0, f"examples in docs/{page} no longer match gradseam:\n{out.stdout[-6000:]}\n{out.stderr[-2000:]}"


def test_doctest_pages_found():
    assert {"options.md", "plugins.md"} <= set(DOCTEST_PAGES)


def test_every_config_key_has_a_section():
    headings = _headings("options.md")
    for key in CheckpointConfig.keys():  # noqa: SIM118 - a classmethod, not a dict
        assert f"`{key}`" in headings, f"docs/options.md has no section for {key}"


def test_every_hook_is_documented():
    specs = [name for name, fn in inspect.getmembers(hookspecs, inspect.isfunction)
             if hasattr(fn, f"{hookspecs.PROJECT}_spec")]
    assert specs, "no hookspecs found"
    headings = " ".join(_headings("plugins.md"))
    for name in specs:
        assert f"`{name}`" in headings, f"docs/plugins.md has no section for the hook {name}"


def test_every_builtin_family_has_a_section():
    headings = _headings("families.md")
    builtin = [i.family.name for i in gradseam.installed() if i.distribution == "gradseam"]
    assert builtin
    for name in builtin:
        assert name in headings, f"docs/families.md has no section for the built-in family {name!r}"


def test_messages_point_at_existing_sections():
    """Error messages and the conformance kit refer readers to the plugin guide and its sections."""
    assert "docs/plugins.md" in PLUGIN_GUIDE and (DOCS / "plugins.md").is_file()
    headings = _headings("plugins.md")
    kit = (ROOT / "core" / "testing.py").read_text(encoding="utf-8")
    for section in re.findall(r"see '([^']+)' in docs/plugins\.md", kit):
        assert section in headings, f"gradseam.testing points to a section {section!r} that docs/plugins.md lacks"
