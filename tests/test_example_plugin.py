"""The example third-party plugin (docs/examples/gradseam-hunyuandit-controlnet) works the way the plugin
guide says.

It is pip-installed, as a separate distribution, into a throw-away ``--target`` directory that only
the subprocesses here put on their path, so the shared environment and this process's registry
never see it: gradseam must find it through the ``gradseam`` entry-point group alone, list it, let its
family take precedence over the class's left-out entry, pass the conformance kit from the plugin's own
repository, and forget it again once it is uninstalled, refusing the class with the left-out reason.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "docs" / "examples" / "gradseam-hunyuandit-controlnet"
CONTROLNET = "diffusers.models.controlnets.controlnet_hunyuan.HunyuanDiT2DControlNetModel"


def _env(site: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "GRADSEAM_PLUGINS"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), env.get("PYTHONPATH")) if p)
    env.update(OMP_NUM_THREADS="1", COLUMNS="250", PYTHONDONTWRITEBYTECODE="1")
    return env


def _run(args: list[str], site: Path, cwd: Path | None = None, timeout: int = 180) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, env=_env(site), cwd=cwd, timeout=timeout)


@pytest.fixture(scope="module")
def installed():
    """(source copy, site dir) with gradseam-hunyuandit-controlnet installed into the site dir; all removed
    afterwards."""
    pytest.importorskip("setuptools", reason="building the example plugin needs setuptools")
    root = Path(tempfile.mkdtemp(prefix="gradseam-hunyuandit-controlnet-"))
    try:
        src, site = root / "src", root / "site"
        # a copy, so the build leaves no build/ or *.egg-info in the repository
        shutil.copytree(EXAMPLE, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__", ".pytest_cache"))
        pip = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
               "--no-cache-dir", "--disable-pip-version-check", "--quiet", "--target", str(site), str(src)]
        out = subprocess.run(pip, capture_output=True, text=True, timeout=180)
        assert out.returncode == 0, f"pip install of the example plugin failed:\n{out.stdout}\n{out.stderr}"
        yield src, site
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_families_and_cli_list_the_plugin_and_its_family_takes_precedence_over_the_left_out_entry(installed):
    """Installed, the plugin is listed beside the built-ins; gradseam leaves the ControlNet out, yet the
    plugin's family patches it, and ``gradseam.unsupported_models()`` (what ``gradseam families`` lists as
    left out) no longer lists it. One interpreter for the Python side, one for the command."""
    src, site = installed
    code = (
        "import json, sys\n"
        f"sys.path.insert(0, {str(src / 'tests')!r})\n"
        "import gradseam\n"
        "from test_controlnet import tiny_controlnet\n"
        "from diffusers.models.controlnets.controlnet_hunyuan import HunyuanDiT2DControlNetModel\n"
        "from gradseam.registry import REGISTRY\n"
        "rows = [[i.family.name, i.plugin, i.distribution] for i in gradseam.installed()]\n"
        "left_out = REGISTRY.unsupported_reason(HunyuanDiT2DControlNetModel) is not None\n"
        f"listed = {CONTROLNET!r} in gradseam.unsupported_models()\n"
        "config = {'gradient_checkpointing': True, 'gradient_checkpointing_interval': 2}\n"
        "handle = gradseam.patch(tiny_controlnet(), config)\n"
        "print(json.dumps({'rows': rows, 'family': handle.family.name, 'left_out': left_out, 'listed': listed, "
        "'summary': str(handle.summary())}))\n"
    )
    out = _run([sys.executable, "-c", code], site)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    rows = result["rows"]
    assert ["hunyuandit-controlnet", "hunyuandit-controlnet", "gradseam-hunyuandit-controlnet"] in rows
    assert {"flux", "wan", "hunyuandit"} <= {r[0] for r in rows}  # the built-ins are still there
    assert result["left_out"], "the test rests on gradseam leaving the class out"
    assert not result["listed"], "a class an installed family claims is not listed as left out"
    assert result["family"] == "hunyuandit-controlnet", result
    assert "recompute chunks of 2 blocks" in result["summary"], result["summary"]

    cli = _run([sys.executable, "-m", "gradseam", "families"], site)
    assert cli.returncode == 0, cli.stderr
    found = [line for line in cli.stdout.splitlines() if " hunyuandit-controlnet " in line]
    assert found and "gradseam-hunyuandit-controlnet" in found[0], cli.stdout
    assert "HunyuanDiT2DControlNetModel" in found[0], cli.stdout


def test_plugin_passes_the_conformance_kit_from_its_own_repository(installed):
    """The plugin's own tests: the kit's whole matrix on a tiny ControlNet, exact to the bit. The repository
    has no conftest.py and no pytest settings, as the guide's minimal setup: no warning about the kit's
    ``compiled`` marker, and the compiled rows are left out until ``-m compiled`` asks for them."""
    src, site = installed
    out = _run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W",
                "error::pytest.PytestUnknownMarkWarning", "tests"], site, cwd=src, timeout=300)
    summary = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""
    assert out.returncode == 0, f"{out.stdout[-4000:]}\n{out.stderr[-2000:]}"
    assert " passed" in summary and "failed" not in summary and "skipped" not in summary, summary
    assert "PytestUnknownMarkWarning" not in out.stdout + out.stderr
    assert " deselected" in summary and "compiled-backend row(s) deselected" in out.stdout, summary
    assert not (src / "conftest.py").exists() and not (src / "tests" / "conftest.py").exists()


def test_uninstalling_brings_the_clear_error_back(installed):
    src, site = installed
    site = Path(shutil.copytree(site, site.parent / "site-uninstalled"))
    # What `pip uninstall` does: remove every file the distribution's RECORD lists, then the record.
    (dist_info,) = site.glob("gradseam_hunyuandit_controlnet-*.dist-info")
    for line in (dist_info / "RECORD").read_text().splitlines():
        path = site / line.split(",")[0]
        if path.is_file():
            path.unlink()
    shutil.rmtree(dist_info, ignore_errors=True)
    assert not list(site.glob("gradseam_hunyuandit_controlnet*"))
    code = (
        "import json, sys\n"
        f"sys.path.insert(0, {str(src / 'tests')!r})\n"
        "import gradseam\n"
        "from test_controlnet import tiny_controlnet\n"
        "try:\n"
        "    gradseam.patch(tiny_controlnet(), gradient_checkpointing=True)\n"
        "    error = None\n"
        "except gradseam.UnsupportedModelError as exc:\n"
        "    error = str(exc)\n"
        "print(json.dumps({'families': [f.name for f in gradseam.families()], 'error': error}))\n"
    )
    out = _run([sys.executable, "-c", code], site)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert "hunyuandit-controlnet" not in result["families"]
    error = result["error"]
    assert error is not None, "a HunyuanDiT ControlNet was patched without the plugin installed"
    # the left-out refusal, with its reason, not the generic "no gradseam family handles ..."
    assert error.startswith(f"gradseam does not patch {CONTROLNET}: a ControlNet (gradseam has no ControlNet"), \
        error
    assert "takes precedence" in error and "docs/plugins.md" in error and "flux" in error, error
