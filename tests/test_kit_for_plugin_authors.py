"""The conformance kit as a plugin author meets it: the tests the plugin guide lists are the kit's, and a
test file that only subclasses ``ConformanceSuite`` runs without setup, without a warning, and without the
slow compiled rows unless asked for (issue 37).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gradseam.testing import COMPILED_MARK, ConformanceSuite

DOCS = Path(__file__).resolve().parents[1] / "docs"


def _suite_table_tests() -> list[str]:
    """The test names in plugins.md's table of what a ConformanceSuite runs (``| test | checks |``)."""
    lines = (DOCS / "plugins.md").read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| test | checks |"))
    names = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        names += [re.sub(r"\[.*\]$", "", name) for name in re.findall(r"`(test_[^`]+)`", line.split("|")[1])]
    return names


def test_the_plugin_guide_lists_exactly_the_kits_tests():
    documented = _suite_table_tests()
    real = sorted(name for name in dir(ConformanceSuite)
                  if name.startswith("test_") and callable(getattr(ConformanceSuite, name)))
    missing = sorted(set(documented) - set(real))
    assert not missing, f"docs/plugins.md lists kit tests that do not exist: {missing}; the kit has {real}"
    assert sorted(set(documented)) == real, f"docs/plugins.md does not list {sorted(set(real) - set(documented))}"


# -- a plugin's own test file, run by pytest in a directory of its own -----------------------------------

PLUGIN_TESTS = '''
    """A third-party family's tests: a tiny model, a runtime registration, the kit; no conftest, no ini."""

    import torch
    from torch import nn

    import gradseam
    from gradseam import BlockClass, BlockList, Carry, Family, hookimpl
    from gradseam.testing import Case, ConformanceSuite


    class Attention(nn.Module):
        def __init__(self, dim=8):
            super().__init__()
            self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

        def forward(self, x):
            q, k, v = self.qkv(x).chunk(3, dim=-1)
            return self.out(torch.nn.functional.scaled_dot_product_attention(q, k, v))


    class Block(nn.Module):
        def __init__(self, dim=8):
            super().__init__()
            self.attn = Attention(dim)
            self.ff = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

        def forward(self, hidden_states):
            h = hidden_states + self.attn(hidden_states)
            return h + self.ff(h)


    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(4))

        def forward(self, hidden_states):
            for block in self.blocks:
                hidden_states = block(hidden_states)
            return (hidden_states,)


    FAMILY = Family("authors-tiny", models=(Model,),
                    block_lists=(BlockList("blocks", carry=Carry({"hidden_states": None})),),
                    block_classes=(BlockClass(Block, ffn=(("ff",),), attention=("attn",)),))


    class Plugin:
        @hookimpl
        def register_families(self, register):
            register(FAMILY)


    gradseam.register(Plugin(), name="authors-tiny")


    def inputs(g):
        return {"hidden_states": torch.randn(1, 6, 8, generator=g).requires_grad_(True)}


    class TestTiny(ConformanceSuite):
        case = Case("authors-tiny", Model, inputs)
'''


def _pytest(where: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("GRADSEAM_PLUGINS", "PYTEST_ADDOPTS")}
    env.update(OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1", COLUMNS="200")
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-W", "error::pytest.PytestUnknownMarkWarning",
         *args],
        capture_output=True, text=True, cwd=where, env=env, timeout=300,
    )


@pytest.fixture(scope="module")
def plugin_repo(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("plugin-repo")
    (root / "tests").mkdir()
    (root / "tests" / "test_tiny.py").write_text(textwrap.dedent(PLUGIN_TESTS))
    return root


def _ids(out: subprocess.CompletedProcess) -> list[str]:
    return [line.strip() for line in out.stdout.splitlines() if "::" in line]


def _compiled(ids: list[str]) -> list[str]:
    # test_strategy[compile], test_offload[unsloth-compile], test_quantized_base[torchao-int8-unsloth-compile]
    return [i for i in ids if re.search(r"[\[-](unsloth-)?compile\]", i)]


def test_a_plugins_kit_collects_without_setup_or_warning_and_leaves_compiled_rows_out(plugin_repo):
    out = _pytest(plugin_repo, "--collect-only", "-q", "tests")
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    assert "PytestUnknownMarkWarning" not in text and "warning" not in text.lower(), text[-4000:]
    ids = _ids(out)
    assert any("test_strategy[torch]" in i for i in ids) and any("test_declaration_matches_the_model" in i for i in ids)
    assert _compiled(ids) == [], f"compiled rows collected by default: {_compiled(ids)}"
    assert re.search(r"\d+/\d+ tests collected \(3 deselected\)", out.stdout), out.stdout[-2000:]
    assert "gradseam.testing: 3 compiled-backend row(s) deselected; run them with -m compiled" in out.stdout


# "compiled or not compiled" is the union of the two: each alone shows that -m, once given, decides both ways
@pytest.mark.parametrize(("marks", "compiled", "plain"), [
    ("compiled", 3, False),
    ("not compiled", 0, True),
])
def test_m_selects_the_compiled_rows(plugin_repo, marks, compiled, plain):
    """``-m`` decides once it is given, with the marker declared: ``--strict-markers`` passes too."""
    out = _pytest(plugin_repo, "--collect-only", "-q", "--strict-markers", "-m", marks, "tests")
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    ids = _ids(out)
    assert len(_compiled(ids)) == compiled, ids
    assert any("test_strategy[torch]" in i for i in ids) is plain
    assert "compiled-backend row(s) deselected" not in out.stdout


def test_a_plugins_kit_runs_green_without_a_warning(plugin_repo):
    out = _pytest(plugin_repo, "-q", "-k", "declaration or no_grad or refuses or (strategy and torch-ffn)", "tests")
    summary = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    assert " passed" in summary and "warning" not in summary and "failed" not in summary, summary


def test_the_marker_line_names_the_mark():
    from gradseam.testing import MARKERS

    assert [line.split(":")[0] for line in MARKERS] == [COMPILED_MARK]


def test_the_hooks_recognise_a_suite_by_the_attribute_the_suite_class_sets():
    """The pytest hooks tell the kit's tests from others by an attribute every suite class inherits (they do not
    import the suite, which registers them): its name in the hooks and on the class must agree."""
    from gradseam.testing import ConformanceSuite
    from gradseam.testing.plugin import SUITE_ATTRIBUTE

    class Mine(ConformanceSuite):
        pass

    assert getattr(Mine, SUITE_ATTRIBUTE) is True
    assert getattr(object, SUITE_ATTRIBUTE, False) is False
