"""The docs site builds offline with ``mkdocs build --strict``, its examples run, and it covers
every config key, hook and built-in family."""

from __future__ import annotations

import html
import importlib.util
import inspect
import json
import os
import re
import subprocess
import sys
import textwrap
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
    def absent(name: str) -> bool:
        try:
            return importlib.util.find_spec(name) is None
        except ModuleNotFoundError:  # a dotted name whose parent package is missing
            return True

    missing = [m for m in ("mkdocs", "mkdocstrings", "mkdocstrings_handlers.python") if absent(m)]
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
    assert "register(CONTROLNET)" in plugins and "class TestControlNet(ConformanceSuite)" in plugins, \
        "snippets not included"
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
    kit = "\n".join(p.read_text(encoding="utf-8") for p in sorted((ROOT / "core" / "testing").glob("*.py")))
    for section in re.findall(r"see '([^']+)' in docs/plugins\.md", kit):
        assert section in headings, f"gradseam.testing points to a section {section!r} that docs/plugins.md lacks"


# -- what a newcomer reads first: the pages agree with the code and with each other ------------------

NUMBER_WORDS = {5: "five", 6: "six", 7: "seven", 8: "eight", 9: "nine", 10: "ten", 11: "eleven", 12: "twelve",
                13: "thirteen"}


def _table_first_cells(page: str, header: str) -> list[str]:
    """The first column of the markdown table whose header row starts with ``| header |``."""
    lines = (DOCS / page).read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {header} |"))
    cells = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells.append(line.split("|")[1].strip())
    return cells


def test_options_table_lists_every_key_and_counts_them():
    keys = CheckpointConfig.keys()  # noqa: SIM118 - a classmethod, not a dict
    assert sorted(_table_first_cells("options.md", "key")) == sorted(f"`{k}`" for k in keys)
    text = (DOCS / "options.md").read_text(encoding="utf-8")
    assert f"gradseam reads {NUMBER_WORDS[len(keys)]} keys" in text
    # the interval's default is said once, in the table, and as what it does
    assert "null (one block per region)" in text and "(= 1)" not in text


def test_trainer_table_lists_every_run_flag():
    from gradseam.tools.launch import FLAG_KEYS

    rows = _table_first_cells("trainer.md", "option")
    text = (DOCS / "trainer.md").read_text(encoding="utf-8")
    for flag, key in FLAG_KEYS.items():
        row = next((r for r in rows if r.startswith(f"`{flag}")), None)
        assert row is not None, f"docs/trainer.md's option table lacks {flag}"
        assert f"| {row} | `{key}` |" in text, f"{flag} is not shown with its key {key}"


def _code_lines(text: str, lang: str = "bash") -> list[str]:
    blocks = re.findall(rf"```{lang}\n(.*?)```", text, re.DOTALL)
    return [line.strip() for block in blocks for line in block.splitlines() if line.strip()]


def test_getting_started_installs_and_tests_as_the_readme_does():
    """The README's commands, in getting-started too: torch's CPU build alone with --index-url (which
    replaces the package index for its whole command, so never on the install of everything else),
    the install, the quick subset, the full suite."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    start = readme.index("## Two commands")
    commands = _code_lines(readme[start:readme.index("\n## ", start + 1)])
    assert len(commands) == 4, commands
    torch_cpu, install, full, quick = commands
    assert torch_cpu.startswith("pip install torch --index-url ") and "-e" not in torch_cpu.split("#")[0]
    assert install.startswith("pip install -e ") and "index-url" not in install
    assert quick.startswith('python -m pytest -n 2 -m "not slow"')
    assert full.split("#")[0].split() == ["python", "-m", "pytest", "-n", "auto"]  # everything: no -m
    guide = _code_lines((DOCS / "getting-started.md").read_text(encoding="utf-8"))
    for line in commands:
        assert line in guide, f"docs/getting-started.md lacks the README's {line!r}"
    installs = [line for line in guide if line.startswith("pip install")]
    tests = [line for line in guide if "pytest" in line and "-m cuda" not in line.split("#")[0]]
    assert installs == [torch_cpu, install] and tests == [full, quick], (installs, tests)


def test_the_quick_subset_is_registered_and_its_times_are_the_same_everywhere():
    """`-m "not slow"` needs the mark registered (pytest warns on an unknown mark, and the quick subset
    is only quick if conftest marks what is slow); README and getting-started give one set of figures."""
    import tomllib

    markers = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["pytest"]["ini_options"]
    assert any(m.startswith("slow:") for m in markers["markers"])
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    guide = (DOCS / "getting-started.md").read_text(encoding="utf-8")
    assert "several minutes" not in guide
    figures = re.search(r'-m "not slow"\s+# the quick subset first: ([\d,]+) tests, ([\d.]+) min', readme)
    assert figures is not None
    count, minutes = figures.groups()
    assert float(minutes) < 2, "the quick subset is for under two minutes on two cores"
    assert f"{count} tests, took {minutes} minutes" in " ".join(guide.split())


def test_readme_config_example_names_every_key():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    start = readme.index("## Use it")
    example = re.search(r"```python\n(.*?)```", readme[start:], re.DOTALL).group(1)
    keys = CheckpointConfig.keys()  # a classmethod: the config keys, not a mapping's
    for key in keys:
        assert f'"{key}"' in example, f"the README's config example lacks {key!r}"


def test_figures_agree_across_the_docs_and_the_demo():
    """The same measurement is quoted with the same figure wherever it appears (docs/benchmarks.md's)."""
    from gradseam.tools import cli

    bench = (DOCS / "benchmarks.md").read_text(encoding="utf-8")
    # Wan 2.1 14B, unsloth-compile at budget 0.1, all 40 blocks
    assert "| **`unsloth-compile`** (B = 0.1) | 6.33 | 6.33 | 0.00 | **6.33** | 26.8 | 13,395 | **~1.01** |" in bench
    demo_rule = inspect.getsource(cli.demo)
    assert "6.33 GiB at ~1.01x" in demo_rule and "6.3 GiB at ~1.02x" not in demo_rule
    # Flux dev 4k `torch`: 1.44x in the eager rows' run, 1.45x in the compiled backends' run
    assert "|  | torch | 2.12 | 0.079 | 0.0 | 675 | 1.44 |" in bench
    assert "| `torch` | 2.13 | 0.079 | 0 | 687 | 1.45 |" in bench
    for page in (ROOT / "README.md", DOCS / "strategies.md"):
        text = " ".join(page.read_text(encoding="utf-8").split())
        # the eager list beside `unsloth` (0.68 GiB, 1.46x) is the eager run's
        assert "`torch` (2.1 GiB, 1.44x)" in text and "`torch` (2.1 GiB, 1.45x)" not in text, page.name


def test_index_lists_every_backend_and_promises_what_each_keeps():
    from gradseam.backends import CATALOG

    index = (DOCS / "index.md").read_text(encoding="utf-8")
    listed = re.search(r'"gradient_checkpointing_backend": "[^"]+",\s*# (.*)', index).group(1)
    assert [b.strip() for b in listed.split("|")] == list(CATALOG)
    flat = " ".join(index.split())
    assert "every family and every strategy." not in flat  # bit-exactness is the eager backends' promise
    assert "within a documented tolerance" in flat and "reliability.md#compiled-backends" in flat


def test_readme_says_the_demos_real_step_count():
    from gradseam.tools import cli, demo

    default = inspect.signature(cli.demo).parameters["steps"].default
    assert default == inspect.signature(demo.run).parameters["steps"].default
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert f"one warm-up step and {default} timed steps" in readme
    assert "x 4 training steps" not in readme


def test_readme_names_every_error_type_a_config_can_raise():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "Every mistake is a `ValueError`" not in readme
    for name in ("`ValueError`", "`TypeError`", "UnsupportedStrategyError", "UnsupportedModelError"):
        assert name in readme


def test_strategies_page_opens_with_a_backend_guide_before_any_figure():
    from gradseam.backends import CATALOG

    text = (DOCS / "strategies.md").read_text(encoding="utf-8")
    guide = text.index("## Which backend?")
    figure = r"\d(\.\d+)?x\b|\d(\.\d+)? GiB"  # a measured ratio or size, e.g. "1.13x", "9.64 GiB"
    first_figure = re.search(figure, text)
    assert first_figure is not None and guide < first_figure.start(), "the guide must come before the numbers"
    section = text[guide:text.index("\n## ", guide + 1)]
    assert "benchmarks.md" in section and not re.search(figure, section)  # the figures are linked, not copied
    for backend in CATALOG:
        assert f"`{backend}`" in section, f"the backend guide does not mention {backend}"
    assert "gradient_checkpointing_offload_attention" in section and "no CUDA" in section


@pytest.mark.parametrize("page", ["README.md", "docs/getting-started.md"])
def test_gpu_requirements_and_tested_versions(page):
    text = (ROOT / page).read_text(encoding="utf-8")
    assert "## What needs a GPU, and which torch" in text
    section = text[text.index("## What needs a GPU"):]
    floor = re.search(r'"torch>=([\d.]+)"', (ROOT / "pyproject.toml").read_text(encoding="utf-8")).group(1)
    assert f"torch ≥ {floor}" in section, "the page must state pyproject's torch floor"
    assert re.search(r"[Tt]ested on", section) and "2.13" in section and "2.11" in section
    for needs_cuda in ("`unsloth`", "`unsloth-ffn`", "`gradient_checkpointing_offload_attention`"):
        assert needs_cuda in section


def _families_chart():
    """docs/scripts/families_chart.py, loaded as a module (it is a script, not part of the package)."""
    spec = importlib.util.spec_from_file_location("families_chart", DOCS / "scripts" / "families_chart.py")
    chart = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(chart)
    return chart


def test_families_chart_draws_every_family_the_benchmarks_page_lists(tmp_path):
    """The chart on the benchmarks page is drawn from the committed JSON of every family its command
    names: a family whose data is missing, or a row (like HunyuanVideo's compiled OOM of 2026-12-02) the
    script cannot place, fails here rather than leaving a stale picture."""
    pytest.importorskip("matplotlib")
    text = (DOCS / "benchmarks.md").read_text(encoding="utf-8")
    command = re.search(r"python docs/scripts/families_chart\.py ((?:.*\\\n)*.*)", text)
    assert command, "benchmarks.md no longer gives the families chart's command"
    families = command.group(1).replace("\\", " ").split()
    assert len(families) >= 15 and (DOCS / "img" / "families-full-depth.png").exists()
    chart = _families_chart()
    loaded = {f: chart.load(f) for f in families}
    assert all(rows for _, rows in loaded.values()), "a family of the command has no full-depth rows"
    # a row that failed (an OOM, a compiler error) is drawn as a cross, never left out: make one failed
    label, rows = loaded[families[0]]
    loaded[families[0]] = (label, [{**r, "status": "OOM"} if r["strategy"] == "unsloth-compile" else r for r in rows])
    chart.load = loaded.__getitem__
    chart.draw(families, tmp_path / "chart.png")
    assert (tmp_path / "chart.png").stat().st_size > 10_000


def test_families_table_gives_the_figures_the_benchmarks_page_shows_and_the_chart_names_the_card():
    """``families_chart.py --table`` writes the page's families table from the committed JSON: for families measured
    at the full depth, each of its rows (past the family's name, which the page writes in full) is the page's row,
    bold marks aside. The chart's title names the card the JSON recorded (H200 for runs from before the field)."""
    chart = _families_chart()
    page = (DOCS / "benchmarks.md").read_text(encoding="utf-8").replace("**", "")
    lines = chart.table(["hidream", "ideogram4"]).splitlines()
    assert len(lines) == 2 + 8
    for line in lines[2:]:
        tail = line.split(" | ", 2)[2] if not line.startswith("| | |") else line
        assert tail in page, line
    assert chart.card("hidream") == "H200"
    data = json.loads((DOCS / "data" / "bench-hidream-full.json").read_text())
    assert "gpu" not in data, "this run names its card now: the test's H200 comes from the default, check it"


def test_a_familys_weight_streaming_run_adds_its_row_to_the_families_table_against_the_main_runs_none():
    """Issue 42's weight-streaming row is measured in a run of its own (``bench-FAMILY-stream.json``, one row, so no
    none beside it): the table and the chart add it to the family's rows, its ratio taken against the main run's none,
    and a family without such a run keeps its four rows."""
    chart = _families_chart()
    streamed = json.loads((DOCS / "data" / "bench-sana-wm-refiner-stream.json").read_text())["full_depth"][0]
    assert streamed["vs_none"] is None and streamed["strategy"] == chart.STREAMED
    _, rows = chart.load("sana-wm-refiner")
    none = next(r for r in rows if r["strategy"] == "none")
    row = next(r for r in rows if r["strategy"] == chart.STREAMED)
    assert row["vs_none"] == round(streamed["step_ms"] / none["step_ms"], 3) and row["vs_none"] > 2
    # predicted from its forward pass's line: marked as the upper bound it is (families_chart.upper_bound)
    assert chart.table(["sana-wm-refiner"]).splitlines()[-1].startswith(
        "| | | `unsloth-compile` + every block's weights streamed | ~11.07 † |")
    assert row["peak_fit"] == "forward" and chart.upper_bound(row) and row["deepest_peak_gib"] == 2.73
    cosmos = {r["strategy"]: r for r in chart.load("cosmos3")[1]}  # a resident row's forward line is not marked
    assert cosmos["unsloth-compile"]["peak_fit"] == "forward" and not chart.upper_bound(cosmos["unsloth-compile"])
    far = next(r for r in chart.load("anyflow-far")[1] if r["strategy"] == chart.STREAMED)
    assert far["peak_fit"] == "step" and not chart.upper_bound(far)  # nor a streamed row fitted on the whole step
    assert len(chart.table(["hidream"]).splitlines()) == 2 + 4


def _issue_42_families(page: str) -> list[str]:
    """The families the benchmarks page's issue-42 chart and table command names."""
    command = re.search(r"families_chart\.py --out docs/img/families-42\.png --table\s([^`]*)`", page)
    assert command, "benchmarks.md no longer gives the issue-42 chart's command"
    return command.group(1).split()


def test_the_issue_42_families_table_on_the_page_is_what_its_command_writes_from_the_committed_runs():
    """Every line of issue 42's families table (44 families, each run's rows and its weight-streaming row) is what
    ``families_chart.py --table`` writes from docs/data for the families its command names, as one block: a run
    added to docs/data without regenerating the table, or a figure edited by hand, fails here."""
    chart = _families_chart()
    page = (DOCS / "benchmarks.md").read_text(encoding="utf-8")
    families = _issue_42_families(page)
    assert len(families) == 44
    written = chart.table(families)
    assert written in page, "regenerate issue 42's families table (the command above it) and paste it whole"
    streamed = [line for line in written.splitlines() if chart.LABELS[chart.STREAMED] in line]
    assert len(streamed) == sum((DOCS / "data" / f"bench-{f}-stream.json").exists() for f in families) >= 25


def test_the_weight_streaming_loops_family_list_is_the_families_chart_of_issue_42_with_each_runs_preset():
    """The loop that measures issue 42's weight-streaming row reads ``docs/data/families-42-presets.txt``: every family
    of the page's issue-42 chart once, at the preset its main run measured (the streamed row is compared with that
    run's none), so no family is left out of the sweep or measured at another size."""
    text = (DOCS / "benchmarks.md").read_text(encoding="utf-8")
    listed = [line.split() for line in (DOCS / "data" / "families-42-presets.txt").read_text().splitlines()]
    assert all(len(entry) == 2 for entry in listed), listed
    assert sorted(family for family, _ in listed) == sorted(_issue_42_families(text))
    for family, preset in listed:
        assert json.loads((DOCS / "data" / f"bench-{family}.json").read_text())["preset"] == preset, family
    assert "done < docs/data/families-42-presets.txt" in text


def test_a_failed_rows_message_stays_on_its_line_of_the_families_table():
    """Sana-WM's compiled row failed at depth 4 with inductor's message, which goes on over several lines with the graph
    node and a traceback (H100, torch 2.11): written as it came, it broke the page's table in two, and joined into one
    line mkdocs read part of it as a link. A failed row shows its message's first line."""
    chart = _families_chart()
    status = next(r["status"] for r in chart.load("sana-wm")[1] if r["strategy"] == "unsloth-compile")
    assert "\n" in status  # the committed run's message, as bench wrote it
    lines = chart.table(["sana-wm"]).splitlines()
    assert len(lines) == 2 + 4 and all(line.startswith("|") and line.endswith("|") for line in lines)
    assert lines[-1].endswith("| error: InductorError: RuntimeError: Tensor must have a last dimension with stride 1 | | | | |")


def test_upstream_tests_script_patches_every_model_a_test_builds(tmp_path):
    """docs/scripts/upstream_tests.py on a two-test stand-in for diffusers' suite: unpatched both pass;
    under a config the test that sees a patched model fails and is reported as the one change, with
    its assertion, so the reliability page's table reports what the patch changed and nothing else."""
    folder = tmp_path / "tests" / "models" / "transformers"
    folder.mkdir(parents=True)
    (folder / "test_models_transformer_tiny.py").write_text(textwrap.dedent("""
        import gradseam
        from diffusers import FluxTransformer2DModel

        def tiny():
            return FluxTransformer2DModel(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1,
                                          attention_head_dim=8, num_attention_heads=2, joint_attention_dim=8,
                                          pooled_projection_dim=8, axes_dims_rope=[2, 2, 4])

        def test_model_is_not_patched():
            assert gradseam.handle_of(tiny()) is None, "patched at construction"

        def test_state_dict_keys_are_the_classes():
            assert all("_orig_mod" not in k and "seam" not in k for k in tiny().state_dict())
        """))
    out = tmp_path / "upstream.json"
    done = subprocess.run([sys.executable, str(DOCS / "scripts" / "upstream_tests.py"), "--tests",
                           str(tmp_path / "tests"), "--json", str(out), "--config", "torch"],
                          capture_output=True, text=True, env=_env(), timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["counts"] == {"unpatched": {"passed": 2}, "torch": {"passed": 1, "failed": 1}}
    ((test, change),) = result["changed"].items()
    assert test.endswith("::test_model_is_not_patched")
    assert change["torch"]["was"] == "passed" and "patched at construction" in change["torch"]["error"]


def test_stream_profile_summary_reads_idle_compute_and_copies_per_direction():
    """docs/scripts/stream_profile.py's summary of a trace, behind the benchmarks page's profile table: the compute
    stream is the one with the most kernel time, its idle gaps counted in the pass of the kernel after them, each copy
    direction's busy time merged, and the time both directions ran at once."""
    spec = importlib.util.spec_from_file_location("stream_profile", DOCS / "scripts" / "stream_profile.py")
    profile = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(profile)

    def kernel(ts: float, dur: float, stream: int, name: str = "k") -> dict:
        return {"cat": "kernel", "ts": ts, "dur": dur, "name": name, "args": {"stream": stream}}

    def copy(ts: float, dur: float, direction: str, nbytes: int) -> dict:
        return {"cat": "gpu_memcpy", "ts": ts, "dur": dur, "name": f"Memcpy {direction} (Pinned)", "args": {"bytes": nbytes}}

    events = [kernel(0, 100, 7), kernel(400, 100, 7, "after a forward wait"), kernel(1000, 100, 7),
              kernel(1300, 100, 7, "after a backward wait"), kernel(0, 50, 9),  # another stream: less kernel time
              copy(100, 300, "HtoD", 2 << 30), copy(200, 100, "HtoD", 0), copy(300, 200, "DtoH", 1 << 30)]
    summary = profile.summarize(events, backward_at=1000)
    assert summary["compute_kernel_ms"] == 0.4 and summary["gpu_span_ms"] == 1.4
    assert summary["compute_idle_forward_ms"] == 0.3  # 100-400
    assert summary["compute_idle_backward_ms"] == 0.7  # 500-1000 (the turnaround: before the backward's first kernel), 1100-1300
    assert (summary["h2d_ms"], summary["h2d_gib"], summary["d2h_ms"], summary["d2h_gib"]) == (0.3, 2.0, 0.2, 1.0)
    assert summary["both_directions_ms"] == 0.1  # 300-400
    assert [g["before"] for g in summary["longest_gaps"]] == ["k", "after a forward wait", "after a backward wait"]
    assert summary["gaps_over_100us"] == 3


def test_pack_cost_packs_every_tensor_of_a_step_one_group_a_batch():
    """docs/scripts/pack_cost.py's step, behind the benchmarks page's pack-cost table (run there on CUDA), on the
    engine's CPU test mode: one group a batch, every tensor packed and copied, the bytes intact."""
    import torch

    from gradseam.offload import OffloadEngine, host_store

    spec = importlib.util.spec_from_file_location("pack_cost", DOCS / "scripts" / "pack_cost.py")
    pack_cost = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pack_cost)
    engine = OffloadEngine(host_store(4, test_mode=True), min_bytes=0, device_test_mode=True)
    batches = [[torch.randn(64) for _ in range(3)] for _ in range(4)]
    seconds, held = pack_cost.one_step(engine, batches)
    assert seconds > 0 and len(held) == 12 and engine.copies == 12
    assert all(torch.equal(engine.unpack(p), t) for p, t in zip(held, [t for b in batches for t in b]))


def test_completing_a_cut_run_gives_the_full_depth_rows_the_committed_json_holds():
    """docs/scripts/complete_cut_run.py rebuilt Allegro's and Mochi's full-depth rows after their runs were cut on an
    H100: from their rows alone it gives back exactly what their JSON holds, so the page's figures are bench's own."""
    from gradseam.tools.bench_report import PARTIAL

    spec = importlib.util.spec_from_file_location("complete_cut_run", DOCS / "scripts" / "complete_cut_run.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    for family in ("allegro", "mochi"):
        data = json.loads((DOCS / "data" / f"bench-{family}.json").read_text())
        cut = {k: v for k, v in data.items() if k not in ("full_depth", "depth", "completed_after_the_run")}
        cut["title"] += PARTIAL  # as bench left it when the run was cut
        done = script.complete(family, cut, data["completed_after_the_run"])
        assert done["full_depth"] == data["full_depth"] and done["depth"] == data["depth"], family
        assert done["title"] == data["title"]
    assert {r["status"] for r in done["full_depth"]} >= {"ok"}
    with pytest.raises(SystemExit, match="exactly two fit depths"):
        script.complete("mochi", {**cut, "rows": [r for r in cut["rows"] if r["depth"] == 2]}, "")
