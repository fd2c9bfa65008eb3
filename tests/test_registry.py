"""The plugin registry: built-in families, runtime plugins, conflicts, GRADSEAM_PLUGINS, cheap import."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
import warnings

import pytest
import torch
from torch import nn

import gradseam
from gradseam import (
    BlockClass,
    BlockList,
    Carry,
    Family,
    PluginConflictError,
    UnsupportedModelError,
    hookimpl,
)
from gradseam.registry import REGISTRY
from gradseam.testing import Case, check_strategy, cpu_configs

# -- a tiny third-party model --------------------------------------------------------------------


class TinyFFN(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.gelu(self.up(x)))


class TinyBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.mix = nn.Linear(dim, dim)
        self.ff = TinyFFN(dim)

    def forward(self, hidden_states: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        h = hidden_states + torch.tanh(self.mix(self.norm(hidden_states))) * scale
        return h + self.ff(h)


class TinyStack(nn.Module):
    """Four blocks in a list, called one after another like a diffusers transformer does."""

    def __init__(self, dim: int = 8, depth: int = 4) -> None:
        super().__init__()
        self.proj_in = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(TinyBlock(dim) for _ in range(depth))
        self.proj_out = nn.Linear(dim, dim)

    def forward(self, hidden_states: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor]:
        hidden_states = self.proj_in(hidden_states)
        for block in self.blocks:
            hidden_states = block(hidden_states, scale)
        return (self.proj_out(hidden_states),)


class TinyStackV2(TinyStack):
    """A subclass: handled by the family of its base through the MRO."""


class OtherStack(TinyStack):
    pass


def tiny_inputs(g: torch.Generator) -> dict:
    return {
        "hidden_states": torch.randn(2, 6, 8, generator=g).requires_grad_(True),
        "scale": torch.randn(8, generator=g).requires_grad_(True),
    }


TINY_CASE = Case("tiny", TinyStack, tiny_inputs)

TINY = Family(
    name="tiny",
    description="a four-block test stack",
    models=(TinyStack,),
    block_lists=(BlockList("blocks", carry=Carry({"hidden_states": None})),),
    block_classes=(BlockClass(TinyBlock, ffn=(("ff",),), attention=("mix",)),),
)


def plugin_of(*families: Family) -> object:
    """A plugin object, as a third-party package would write it."""

    class Plugin:
        @hookimpl
        def register_families(self, register):
            for family in families:
                register(family)

    return Plugin()


@pytest.fixture
def registered():
    """Register plugins for one test; everything is unregistered afterwards, even on failure."""
    names: list[str] = []

    def register(plugin: object, name: str) -> str:
        names.append(name)
        return gradseam.register(plugin, name=name)

    yield register
    for name in names:
        gradseam.unregister(name)
    assert {f.name for f in gradseam.families()} >= {"flux", "wan"}
    assert not any(f.name.startswith("tiny") for f in gradseam.families())


def _run(code: str, **env: str) -> dict:
    environ = {k: v for k, v in os.environ.items() if k != "GRADSEAM_PLUGINS"}
    environ.update(env)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environ, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


# -- built-in families and the cheap import -----------------------------------------------------


def test_builtin_families_listed():
    names = [f.name for f in gradseam.families()]
    assert {"flux", "wan"} <= set(names)
    assert names == sorted(names)
    flux = next(i for i in gradseam.installed() if i.family.name == "flux")
    assert flux.plugin == "flux"
    assert flux.distribution == "gradseam"
    assert flux.version == gradseam.__version__
    assert REGISTRY.get("wan").model_names == ("diffusers.models.transformers.transformer_wan.WanTransformer3DModel",)


def test_get_unknown_family_lists_installed():
    with pytest.raises(KeyError) as info:
        REGISTRY.get("fluxx")
    msg = str(info.value)
    assert "'fluxx'" in msg and "'flux'" in msg and "'wan'" in msg


def test_import_is_cheap_and_lazy():
    code = (
        "import json, sys, time\n"
        "t0 = time.perf_counter()\n"
        "import gradseam\n"
        "dt = time.perf_counter() - t0\n"
        "after_import = sorted(m for m in ('torch', 'diffusers') if m in sys.modules)\n"
        "names = [f.name for f in gradseam.families()]\n"
        "after_families = sorted(m for m in ('torch', 'diffusers') if m in sys.modules)\n"
        "print(json.dumps({'seconds': dt, 'after_import': after_import, 'names': names,\n"
        "                  'after_families': after_families}))\n"
    )
    result = _run(code)
    print(f"import gradseam: {result['seconds'] * 1000:.1f} ms")
    assert result["after_import"] == [], "import gradseam imported torch/diffusers"
    assert {"flux", "wan"} <= set(result["names"])
    # listing families reads adapters only: still no torch, no diffusers
    assert result["after_families"] == []


def test_gradseam_plugins_env_restricts_loading():
    code = "import gradseam, json; print(json.dumps([f.name for f in gradseam.families()]))"
    assert _run(code, GRADSEAM_PLUGINS="wan") == ["wan"]
    assert _run(code, GRADSEAM_PLUGINS=" flux , wan ") == ["flux", "wan"]
    assert _run(code, GRADSEAM_PLUGINS="flux,not-installed") == ["flux"]


# -- runtime plugins ----------------------------------------------------------------------------


def test_runtime_plugin_makes_custom_model_patchable(registered):
    with pytest.raises(UnsupportedModelError, match="TinyStack"):
        gradseam.patch(TinyStack(), gradient_checkpointing=True)
    name = registered(plugin_of(TINY), "tiny-plugin")
    assert name == "tiny-plugin"
    assert "tiny" in [f.name for f in gradseam.families()]
    assert REGISTRY.get("tiny") is TINY
    installed = next(i for i in gradseam.installed() if i.family.name == "tiny")
    assert (installed.plugin, installed.distribution) == ("tiny-plugin", None)
    assert REGISTRY.for_model_type(TinyStack) is TINY
    assert REGISTRY.for_model_type(TinyStackV2) is TINY  # subclasses through the MRO
    for config in cpu_configs():
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            report = check_strategy(TINY_CASE, config)
        assert report.saved_ratio < 1.0
        if config["gradient_checkpointing_backend"] == "torch-ffn" and config["gradient_checkpointing_interval"]:
            # said once per process; the first such config is the one that says it
            assert all("does not group FFN regions" in str(w.message) for w in record)
        else:
            assert [str(w.message) for w in record] == []


def test_runtime_plugin_module(registered):
    module = types.ModuleType("tiny_gradseam_plugin")
    module.register_families = hookimpl(lambda register: register(TINY))
    registered(module, "tiny-module")
    handle = gradseam.patch(TinyStack(), gradient_checkpointing=True)
    try:
        assert handle.family is TINY
    finally:
        handle.remove()


def test_unregister_removes_family_and_model():
    gradseam.register(plugin_of(TINY), name="tiny-plugin")
    try:
        assert REGISTRY.for_model_type(TinyStack) is TINY
    finally:
        gradseam.unregister("tiny-plugin")
    assert "tiny" not in [f.name for f in gradseam.families()]
    assert REGISTRY.for_model_type(TinyStack) is None
    assert not REGISTRY.pm.has_plugin("tiny-plugin")
    with pytest.raises(UnsupportedModelError, match="TinyStack"):
        gradseam.patch(TinyStack(), gradient_checkpointing=True)
    # and it can be registered again afterwards
    gradseam.register(plugin_of(TINY), name="tiny-plugin")
    gradseam.unregister("tiny-plugin")


def test_two_plugins_claiming_one_model_class(registered):
    registered(plugin_of(TINY), "tiny-first")
    rival = Family("tiny-rival", models=(TinyStack,), block_lists=TINY.block_lists, block_classes=TINY.block_classes)
    with pytest.raises(PluginConflictError) as info:
        registered(plugin_of(rival), "tiny-second")
    msg = str(info.value)
    assert "'tiny-first'" in msg and "'tiny-second'" in msg
    assert "'tiny'" in msg and "'tiny-rival'" in msg
    assert f"{TinyStack.__module__}.TinyStack" in msg
    assert "GRADSEAM_PLUGINS" in msg
    # the loser is not half-registered; the first plugin keeps the class
    assert not REGISTRY.pm.has_plugin("tiny-second")
    assert "tiny-rival" not in [f.name for f in gradseam.families()]
    assert REGISTRY.for_model_type(TinyStack) is TINY


def test_plugin_claiming_a_builtin_model_class(registered):
    flux_class = REGISTRY.get("flux").model_names[0]
    hijack = Family("tiny-flux", models=(flux_class,), block_lists=TINY.block_lists, block_classes=())
    with pytest.raises(PluginConflictError) as info:
        registered(plugin_of(hijack), "tiny-hijack")
    msg = str(info.value)
    assert "plugin 'flux'" in msg and "'tiny-hijack'" in msg and flux_class in msg
    assert REGISTRY.get("flux").name == "flux"


def test_same_family_name_twice(registered):
    registered(plugin_of(TINY), "tiny-first")
    same_name = Family("tiny", models=(OtherStack,), block_lists=TINY.block_lists, block_classes=TINY.block_classes)
    with pytest.raises(PluginConflictError) as info:
        registered(plugin_of(same_name), "tiny-second")
    msg = str(info.value)
    assert "family 'tiny'" in msg and "'tiny-first'" in msg and "'tiny-second'" in msg
    assert REGISTRY.get("tiny") is TINY
    assert REGISTRY.for_model_type(OtherStack) is TINY  # through its base, not the rival's declaration


def test_same_family_name_as_builtin(registered):
    clash = Family("wan", models=(TinyStack,), block_lists=TINY.block_lists, block_classes=TINY.block_classes)
    with pytest.raises(PluginConflictError, match=r"family 'wan' is registered by both plugin 'wan' and plugin 'tiny-x'"):
        registered(plugin_of(clash), "tiny-x")
    assert REGISTRY.for_model_type(TinyStack) is None


def test_one_plugin_two_families_rolls_back_both(registered):
    # the second family conflicts: the first one must not stay behind
    first = Family("tiny-a", models=(OtherStack,), block_lists=TINY.block_lists, block_classes=TINY.block_classes)
    clash = Family("flux", models=(TinyStack,), block_lists=TINY.block_lists, block_classes=TINY.block_classes)
    with pytest.raises(PluginConflictError):
        registered(plugin_of(first, clash), "tiny-two")
    assert "tiny-a" not in [f.name for f in gradseam.families()]
    assert REGISTRY.for_model_type(OtherStack) is None


def test_plugin_name_registered_twice(registered):
    registered(plugin_of(TINY), "tiny-plugin")
    with pytest.raises(PluginConflictError, match="'tiny-plugin' is already registered"):
        gradseam.register(plugin_of(TINY), name="tiny-plugin")
    assert REGISTRY.get("tiny") is TINY


def test_register_rejects_non_family(registered):
    class Bad:
        @hookimpl
        def register_families(self, register):
            register({"name": "tiny"})

    with pytest.raises(TypeError) as info:
        registered(Bad(), "tiny-bad")
    msg = str(info.value)
    assert "'tiny-bad'" in msg and "dict" in msg and "Family" in msg
    assert not REGISTRY.pm.has_plugin("tiny-bad")
