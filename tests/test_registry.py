"""The plugin registry: built-in families, runtime plugins, conflicts, GRADSEAM_PLUGINS, cheap import.

Every test here passes with third-party family plugins installed beside gradseam (issue 43; CI runs this
file with the plugin guide's example installed): a test on the shared registry checks that the built-ins
are there and that its own plugin is added or refused, never that nothing else is installed, and a test
that counts what a fresh registry loads sets up its own entry points (:class:`FakeSite`: the built-ins
and the fakes it adds, whatever else the environment holds).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
import warnings

import pytest
import torch
from conftest import builtin_families, builtin_family_plugins, builtin_plugins
from torch import nn

import gradseam
from gradseam import (
    BlockClass,
    BlockList,
    Carry,
    Family,
    PluginConflictError,
    Preset,
    UnsupportedModelError,
    hookimpl,
)
from gradseam.errors import PluginWarning
from gradseam.registry import REGISTRY, Failure, Registry
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
BUILTINS = builtin_plugins()  # pyproject.toml's [project.entry-points.gradseam], sorted
BUILTIN_FAMILIES = builtin_families()  # the families they declare (a plugin may declare several, or none)

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
    """Register plugins for one test; everything is unregistered afterwards, even on failure, and the
    registry lists exactly what it listed before (whatever else is installed)."""
    before = [(i.family.name, i.plugin) for i in gradseam.installed()]
    names: list[str] = []

    def register(plugin: object, name: str) -> str:
        names.append(name)
        return gradseam.register(plugin, name=name)

    yield register
    for name in names:
        gradseam.unregister(name)
    assert [(i.family.name, i.plugin) for i in gradseam.installed()] == before


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
    # every built-in plugin is installed, from gradseam itself (other distributions' plugins may be too)
    assert sorted({i.plugin for i in gradseam.installed() if i.distribution == "gradseam"}) == builtin_family_plugins()
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
    # gradseam's own plugins: a third-party plugin installed here may import torch when it loads
    result = _run(code, GRADSEAM_PLUGINS=",".join(BUILTINS))
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
        if config.get("gradient_checkpointing_backend") == "torch-ffn" and config["gradient_checkpointing_interval"]:
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


def _left_out(*entries: tuple[str, str]) -> types.ModuleType:
    module = types.ModuleType("left_out_plugin")

    def register_unsupported_models(register):
        for model, reason in entries:
            register(model, reason)

    module.register_unsupported_models = hookimpl(register_unsupported_models)
    return module


TINY_PATH = f"{TinyStack.__module__}.{TinyStack.__qualname__}"


def test_a_left_out_model_is_refused_with_its_reason(registered):
    registered(_left_out((TINY_PATH, "a four-block toy, not a model anyone fine-tunes.")), "tiny-left-out")
    assert gradseam.unsupported_models()[TINY_PATH] == "a four-block toy, not a model anyone fine-tunes"
    assert REGISTRY.unsupported_reason(TinyStackV2) is None  # a subclass may be another model: the class only
    with pytest.raises(UnsupportedModelError) as info:
        gradseam.patch(TinyStack(), gradient_checkpointing=True)
    msg = str(info.value)
    assert f"gradseam does not patch {TINY_PATH}: a four-block toy, not a model" in msg
    assert "fine-tunes. Installed families:" in msg and "docs/plugins.md" in msg  # one period, then the rest


def test_a_family_claiming_a_left_out_model_wins(registered):
    registered(_left_out((TINY_PATH, "left out")), "tiny-left-out")
    registered(plugin_of(TINY), "tiny-plugin")
    assert TINY_PATH not in gradseam.unsupported_models()  # gradseam families no longer lists it as left out
    handle = gradseam.patch(TinyStack(), gradient_checkpointing=True)
    try:
        assert handle.family is TINY
    finally:
        handle.remove()


@pytest.mark.parametrize("entry", [("TinyStack", "no module"), (TINY_PATH, "  "), (TINY_PATH, None)])
def test_a_left_out_entry_needs_a_dotted_class_and_a_reason(registered, entry):
    with pytest.raises(TypeError) as info:
        registered(_left_out(entry), "tiny-left-out-bad")
    msg = str(info.value)
    assert "'tiny-left-out-bad'" in msg and "register_unsupported_models" in msg and repr(entry[0]) in msg
    assert not REGISTRY.pm.has_plugin("tiny-left-out-bad")


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
    hijack = Family("tiny-flux", models=(flux_class,), block_lists=TINY.block_lists, block_classes=TINY.block_classes)
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
    with pytest.raises(PluginConflictError) as info:
        registered(plugin_of(clash), "tiny-x")
    assert str(info.value) == (
        f"family 'wan' is registered by both plugin 'wan' (distribution gradseam {gradseam.__version__}, entry "
        "point wan = gradseam.adapters.wan) and plugin 'tiny-x' (registered at runtime). Nothing of plugin "
        "'tiny-x' was registered. Unregister the other plugin, or leave an installed one out with "
        "GRADSEAM_PLUGINS=name,name..."
    )
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


# -- failures leave the registry exactly as it was ------------------------------------------------


def state(registry=REGISTRY) -> tuple:
    """Everything a failed registration could have left behind."""
    return (
        sorted((i.family.name, i.plugin, i.distribution) for i in registry._state.families.values()),
        sorted((model, i.family.name) for model, i in registry._state.by_model.items()),
        sorted(name for name, _ in registry.pm.list_name_plugin()),
        sorted(registry._state.plugins),
        registry._loaded,
    )


def failing_twice(register, *args) -> Exception:
    """Run a registration that must fail, twice: the same error both times, and no trace left."""
    before = state()
    errors = []
    for _ in range(2):
        with pytest.raises(Exception) as info:
            register(*args)
        errors.append(info.value)
        assert state() == before
    assert type(errors[0]) is type(errors[1]) and str(errors[0]) == str(errors[1])
    return errors[0]


def test_hook_raising_names_the_plugin_and_leaves_nothing(registered):
    class Boom:
        @hookimpl
        def register_families(self, register):
            register(TINY)  # accepted into the staging list, then the hook fails: TINY must not stay
            raise ValueError("boom")

    error = failing_twice(registered, Boom(), "tiny-boom")
    assert isinstance(error, gradseam.errors.PluginValueError) and isinstance(error, ValueError)
    assert str(error) == (
        "gradseam plugin 'tiny-boom' (registered at runtime) failed in register_families: ValueError: boom. "
        "Nothing of it was registered."
    )
    assert isinstance(error.__cause__, ValueError)
    assert (error.plugin, error.distribution) == ("tiny-boom", None)
    assert REGISTRY.for_model_type(TinyStack) is None
    # every other family still works
    assert REGISTRY.get("flux").name == "flux"


def test_register_non_family_same_error_on_retry(registered):
    class Bad:
        @hookimpl
        def register_families(self, register):
            register(TINY)
            register(("tiny",))

    error = failing_twice(registered, Bad(), "tiny-bad")
    assert isinstance(error, TypeError)
    assert str(error) == (
        "gradseam plugin 'tiny-bad' (registered at runtime) called register() with tuple; expected a "
        "gradseam.family.Family. Nothing of it was registered."
    )


def test_invalid_family_field_names_field_family_and_plugin(registered):
    class Stringly:
        @hookimpl
        def register_families(self, register):
            register(Family("tiny-str", models=f"{__name__}.TinyStack", block_lists=TINY.block_lists,
                            block_classes=TINY.block_classes))

    error = failing_twice(registered, Stringly(), "tiny-str-plugin")
    assert isinstance(error, TypeError)
    msg = str(error)
    assert msg.startswith("gradseam plugin 'tiny-str-plugin' (registered at runtime) failed in register_families: ")
    assert (
        "TypeError: Family 'tiny-str': field 'models' must be a tuple of model classes or their qualified names, "
        f"got str '{__name__}.TinyStack'. A string here would be read as its characters: write "
        f"('{__name__}.TinyStack',)." in msg
    )


@pytest.mark.parametrize(
    ("hook_name", "expected"),
    [
        ("register_family", "implements 'register_family' (did you mean 'register_families'?), which gradseam "
                            "does not define; gradseam's hooks are ['register_families', 'register_attention_kernels', "
                            "'register_unsupported_models']."),
        ("setup", "implements 'setup', which gradseam does not define; gradseam's hooks are "
                  "['register_families', 'register_attention_kernels', 'register_unsupported_models']."),
    ],
)
def test_misspelled_hook_is_rejected(registered, hook_name, expected):
    plugin = types.SimpleNamespace(**{hook_name: hookimpl(lambda register: register(TINY))})
    error = failing_twice(registered, plugin, "tiny-typo")
    assert isinstance(error, TypeError)
    assert str(error) == f"gradseam plugin 'tiny-typo' (registered at runtime) {expected} Nothing of it was registered."


def test_undecorated_hook_is_rejected(registered):
    class Forgot:
        def register_families(self, register):
            register(TINY)

    error = failing_twice(registered, Forgot(), "tiny-plain")
    assert str(error) == (
        "gradseam plugin 'tiny-plain' (registered at runtime) implements no gradseam hook: its register_families "
        "is not decorated with @gradseam.hookimpl. Nothing of it was registered."
    )


def test_hook_with_a_wrong_parameter_name_is_rejected(registered):
    class WrongArg:
        @hookimpl
        def register_families(self, reg):
            reg(TINY)

    error = failing_twice(registered, WrongArg(), "tiny-arg")
    msg = str(error)
    assert msg.startswith("gradseam plugin 'tiny-arg' (registered at runtime) has an invalid hook: ")
    assert "{'reg'}" in msg and "its parameter must be named `register`" in msg


def test_one_plugin_registering_a_family_twice(registered):
    error = failing_twice(registered, plugin_of(TINY, TINY), "tiny-twice")
    assert isinstance(error, PluginConflictError)
    assert str(error).startswith("gradseam plugin 'tiny-twice' (registered at runtime) registers family 'tiny' twice.")


def test_the_same_object_under_a_second_name(registered):
    plugin = plugin_of(TINY)
    registered(plugin, "tiny-once")
    with pytest.raises(PluginConflictError, match="plugin 'tiny-once' is already registered"):
        gradseam.register(plugin, name="tiny-again")
    assert not REGISTRY.pm.has_plugin("tiny-again")


# -- bare and full class names -------------------------------------------------------------------

FULL = f"{TinyStack.__module__}.TinyStack"


@pytest.mark.parametrize(("first", "second"), [("TinyStack", FULL), (FULL, "TinyStack"), ("TinyStack", TinyStack)])
def test_bare_and_full_claims_of_one_class_conflict(registered, first, second):
    one = Family("tiny-one", models=(first,), block_lists=TINY.block_lists, block_classes=TINY.block_classes)
    two = Family("tiny-two", models=(second,), block_lists=TINY.block_lists, block_classes=TINY.block_classes)
    registered(plugin_of(one), "tiny-p1")
    error = failing_twice(registered, plugin_of(two), "tiny-p2")
    assert isinstance(error, PluginConflictError)
    assert str(error).startswith(
        f"model classes {first if isinstance(first, str) else FULL!r} and {FULL if first == 'TinyStack' else 'TinyStack'!r} "
        "(a bare class name matches a class of that name from any module, so both name one class) are claimed "
        "by family 'tiny-one' (plugin 'tiny-p1', registered at runtime) and family 'tiny-two' (plugin 'tiny-p2', "
        "registered at runtime)."
    )
    assert REGISTRY.for_model_type(TinyStack).name == "tiny-one"


def test_bare_claim_of_a_builtin_class_conflicts(registered):
    # mageflow claims the bare name; a full name in any module is the same claim
    squatter = Family("tiny-mage", models=("somewhere.other.MageFlowTransformer2DModel",),
                      block_lists=TINY.block_lists, block_classes=TINY.block_classes)
    error = failing_twice(registered, plugin_of(squatter), "tiny-mage")
    msg = str(error)
    assert "'MageFlowTransformer2DModel' and 'somewhere.other.MageFlowTransformer2DModel'" in msg
    assert f"family 'mageflow' (plugin 'mageflow', distribution gradseam {gradseam.__version__}" in msg


def test_full_names_in_different_modules_do_not_conflict(registered):
    one = Family("tiny-a1", models=("pkg_a.Model",), block_lists=TINY.block_lists, block_classes=TINY.block_classes)
    two = Family("tiny-a2", models=("pkg_b.Model",), block_lists=TINY.block_lists, block_classes=TINY.block_classes)
    registered(plugin_of(one, two), "tiny-ab")
    assert {"tiny-a1", "tiny-a2"} <= {f.name for f in gradseam.families()}


# -- family declarations are validated where they are written -----------------------------------

_BL, _BC = (BlockList("blocks"),), (BlockClass("pkg.Block"),)


@pytest.mark.parametrize(
    ("build", "error", "message"),
    [
        (lambda: Family("x", models="pkg.Model", block_lists=_BL, block_classes=_BC), TypeError,
         "Family 'x': field 'models' must be a tuple of model classes or their qualified names, got str "
         "'pkg.Model'. A string here would be read as its characters: write ('pkg.Model',)."),
        (lambda: Family("x", models=("pkg.Model",), block_lists="blocks", block_classes=_BC), TypeError,
         "Family 'x': field 'block_lists' must be a tuple of BlockList, got str 'blocks'. A string here would be "
         "read as its characters: write (BlockList('blocks'),)."),
        (lambda: Family("x", models=("pkg.Model",), block_lists=("blocks",), block_classes=_BC), TypeError,
         "Family 'x': field 'block_lists' must hold BlockList objects, got str 'blocks'."),
        (lambda: Family("x", models=("pkg.Model",), block_lists=_BL, block_classes=()), ValueError,
         "Family 'x': field 'block_classes' is empty; a family needs at least one."),
        (lambda: Family("", models=("pkg.Model",), block_lists=_BL, block_classes=_BC), ValueError,
         "Family: field 'name' is ''; a family name is what `gradseam bench --family` takes: letters, digits, "
         "'_', '-' and '.', starting with a letter or digit."),
        (lambda: Family(3, models=("pkg.Model",), block_lists=_BL, block_classes=_BC), TypeError,
         "Family: field 'name' must be a str, got int 3."),
        (lambda: Family("x", models=("pkg.Model", "pkg.Model"), block_lists=_BL, block_classes=_BC), ValueError,
         "Family 'x': field 'models' declares model class 'pkg.Model' twice."),
        (lambda: Family("x", models=("pkg..Model",), block_lists=_BL, block_classes=_BC), ValueError,
         "Family 'x': field 'models' must hold classes or qualified class names, got str 'pkg..Model'."),
        (lambda: Family("x", models=("pkg.Model",), block_lists=_BL, block_classes=_BC, presets={"a": {}}),
         TypeError, "Family 'x': field 'presets' maps 'a' to dict {}; expected a Preset."),
        (lambda: BlockClass("pkg.Block", ffn="ff"), TypeError,
         "BlockClass('Block'): field 'ffn' must be a tuple of seams, each a tuple of submodule paths, got str "
         "'ff'. A string here would be read as its characters: write (('ff',),)."),
        (lambda: BlockClass("pkg.Block", ffn=("ff",)), TypeError,
         "BlockClass('Block'): field 'ffn' must be a tuple of seams, each a tuple of submodule paths, got tuple "
         "('ff',) (item str 'ff'); one seam of one module is written (('ff',),)."),
        (lambda: BlockClass("pkg.Block", ffn=(("ff",), ("norm", "ff"))), ValueError,
         "BlockClass('Block'): field 'ffn' names 'ff' twice; a submodule belongs to one seam at most (it would "
         "be checkpointed inside its own checkpoint)."),
        (lambda: BlockClass("pkg.Block", ffn=((),)), ValueError,
         "BlockClass('Block'): field 'ffn' holds an empty seam; a seam names at least one submodule."),
        (lambda: BlockClass("pkg.Block", attention="attn"), TypeError,
         "BlockClass('Block'): field 'attention' must be a tuple of submodule paths, got str 'attn'. A string "
         "here would be read as its characters: write ('attn',)."),
        (lambda: BlockClass("pkg.Block", attention=("attn", None)), TypeError,
         "BlockClass('Block'): field 'attention' must be a tuple of submodule paths, got tuple ('attn', None) "
         "(item NoneType None)."),
        (lambda: BlockClass("pkg.Block", attention=("attn.",)), ValueError,
         "BlockClass('Block'): field 'attention' holds 'attn.', which is not a submodule path (attribute names "
         "separated by dots, e.g. 'ff' or 'attn.to_out.0')."),
        (lambda: BlockClass(""), ValueError,
         "BlockClass: field 'cls' must be a class or its qualified name (e.g. "
         "'diffusers.models.attention.JointTransformerBlock'), got str ''."),
        (lambda: BlockList("blocks", carry={"hidden_states": None}), TypeError,
         "BlockList('blocks'): field 'carry' must be a Carry or None, got dict {'hidden_states': None}. Wrap it: "
         "carry=Carry({'hidden_states': None})."),
        (lambda: BlockList(""), ValueError,
         "BlockList(''): field 'path' is not an attribute path (attribute names separated by dots, e.g. "
         "'transformer_blocks' or 'text_fusion.layerwise_blocks')."),
        (lambda: BlockList("blocks", optional="yes"), TypeError,
         "BlockList('blocks'): field 'optional' must be True or False, got str 'yes'."),
        (lambda: BlockList("blocks", per_block="layer_cache"), TypeError,
         "BlockList('blocks'): field 'per_block' must be a tuple of argument names (a dotted name reaches into a "
         "dict argument), got str 'layer_cache'. A string here would be read as its characters: write "
         "('layer_cache',)."),
        (lambda: BlockList("blocks", per_block=("layer_cache", None)), TypeError,
         "BlockList('blocks'): field 'per_block' must be a tuple of argument names (a dotted name reaches into a "
         "dict argument), got tuple ('layer_cache', None) (item NoneType None)."),
        (lambda: BlockList("blocks", per_block=("joint_attention_kwargs.",)), ValueError,
         "BlockList('blocks'): field 'per_block' holds 'joint_attention_kwargs.', which is not an argument name: "
         "a parameter of the block's forward, then optionally dict keys separated by dots (e.g. 'layer_cache' or "
         "'joint_attention_kwargs.kv_cache')."),
        (lambda: BlockList("blocks", per_block=("kv cache",)), ValueError,
         "BlockList('blocks'): field 'per_block' holds 'kv cache', which is not an argument name: a parameter of "
         "the block's forward, then optionally dict keys separated by dots (e.g. 'layer_cache' or "
         "'joint_attention_kwargs.kv_cache')."),
        (lambda: BlockList("blocks", per_block=("layer_cache", "layer_cache")), ValueError,
         "BlockList('blocks'): field 'per_block' names 'layer_cache' twice."),
        (lambda: BlockList("blocks", carry=Carry({"hidden_states": None}), per_block=("hidden_states.cache",)),
         ValueError,
         "BlockList('blocks'): field 'per_block' names 'hidden_states.cache', which the carry hands from each block "
         "to the next; a per-block state is what the model's loop passes each block, not a block's output."),
        (lambda: BlockList("blocks", called_outside="norm1.emb"), TypeError,
         "BlockList('blocks'): field 'called_outside' must be a tuple of (block index, submodule path) pairs, e.g. "
         "((0, 'norm1.emb'),), got str 'norm1.emb'. A string here would be read as its characters: write "
         "((0, 'norm1.emb'),)."),
        (lambda: BlockList("blocks", called_outside=(("0", "norm1.emb"),)), TypeError,
         "BlockList('blocks'): field 'called_outside' must be a tuple of (block index, submodule path) pairs, e.g. "
         "((0, 'norm1.emb'),), got tuple (('0', 'norm1.emb'),) (item tuple ('0', 'norm1.emb'))."),
        (lambda: BlockList("blocks", called_outside=((0, "norm1.emb"), (0, "norm1.emb"))), ValueError,
         "BlockList('blocks'): field 'called_outside' names a submodule twice: ((0, 'norm1.emb'), (0, 'norm1.emb'))."),
        (lambda: Carry({"hidden_states": -1}), ValueError,
         "Carry: field 'outputs' maps 'hidden_states' to -1; positions count from 0 (negative indices would "
         "silently follow the length of the returned tuple)."),
        (lambda: Carry({"hidden_states": "0"}), TypeError,
         "Carry: field 'outputs' maps 'hidden_states' to str '0'; expected a position in the block's returned "
         "tuple (int >= 0), or None when the block returns that one tensor."),
        (lambda: Carry({"hidden_states": True}), TypeError,
         "Carry: field 'outputs' maps 'hidden_states' to bool True; expected a position in the block's returned "
         "tuple (int >= 0), or None when the block returns that one tensor."),
        (lambda: Carry({"hidden_states": None, "encoder_hidden_states": 0}), ValueError,
         "Carry: field 'outputs' maps 'hidden_states' to None (the block returns that one tensor), so it cannot "
         "also carry ['encoder_hidden_states']; use tuple positions instead."),
        (lambda: Carry({}), ValueError,
         "Carry: field 'outputs' is empty; name the parameter(s) each block hands to the next."),
        (lambda: Carry({"hidden states": 0}), ValueError,
         "Carry: field 'outputs' key 'hidden states' is not a parameter name."),
        (lambda: Carry("hidden_states"), TypeError,
         "Carry: field 'outputs' must be a mapping of the block's forward parameter names to positions in its "
         "return value (int >= 0, or None for a block returning one tensor), got str 'hidden_states'; e.g. "
         "Carry({'hidden_states': None})."),
        (lambda: Preset("p", config=[("num_layers", 2)]), TypeError,
         "Preset('p'): field 'config' must be a mapping of keyword-argument names (str) to values, got list "
         "[('num_layers', 2)]."),
        (lambda: Preset("p", config={}, make_inputs="make_inputs"), TypeError,
         "Preset('p'): field 'make_inputs' must be a function or None, got str 'make_inputs'."),
    ],
)
def test_declarations_validate_their_fields(build, error, message):
    with pytest.raises(error) as info:
        build()
    assert str(info.value) == message


def test_declarations_are_normalised_and_private():
    outputs = {"hidden_states": None}
    carry = Carry(outputs)
    outputs["extra"] = 0  # the caller's dict changing later must not change the declaration
    assert carry.outputs == {"hidden_states": None}
    declared = BlockClass("pkg.Block", ffn=[["norm2", "ff"]], attention=["attn"])
    assert declared.ffn == (("norm2", "ff"),) and declared.attention == ("attn",)
    family = Family("x", models=["pkg.Model"], block_lists=[BlockList("blocks.0.inner")], block_classes=[declared])
    assert family.models == ("pkg.Model",) and isinstance(family.block_lists, tuple)
    assert BlockList("layers.3").path == "layers.3"  # a ModuleList index is a path step
    assert BlockList("blocks", per_block=["layer_cache", "kwargs.kv_cache"]).per_block == (
        "layer_cache", "kwargs.kv_cache"
    )
    outside = BlockList("blocks", called_outside=[(0, "norm1.emb"), (-1, "proj")])
    assert outside.called_outside == ((0, "norm1.emb"), (-1, "proj"))
    assert outside.outside(0, 4) == ("norm1.emb",) and outside.outside(3, 4) == ("proj",) and not outside.outside(1, 4)
    from dataclasses import replace

    assert replace(family, name="y").block_classes == (declared,)  # replace() validates again, and passes


# -- entry points: third-party distributions, faked on disk ---------------------------------------


class FakeSite:
    """Installed distributions for a fresh :class:`Registry`: the real built-ins plus fakes, and nothing else.

    Each fake is a real ``.dist-info`` read by ``importlib.metadata`` (so ``EntryPoint.dist`` is
    real); ``importlib.metadata.entry_points``, as the registry calls it, returns the built-ins'
    entry points (gradseam's own distribution's: a third-party plugin installed in the environment is
    left out, so what these tests count is what they set up) followed by the fakes'. Plugin modules go
    to a directory on ``sys.path``.
    """

    def __init__(self, root, monkeypatch) -> None:
        from importlib import metadata

        self.dists_dir, self.modules_dir = root / "dists", root / "modules"
        self.dists_dir.mkdir()
        self.modules_dir.mkdir()
        self.dists: list = []
        self.builtins = True
        monkeypatch.syspath_prepend(str(self.modules_dir))
        real = metadata.entry_points

        def entry_points(**params):
            if params.get("group") != "gradseam":
                return real(**params)
            found = [ep for ep in real(group="gradseam") if _builtin(ep)] if self.builtins else []
            for dist in self.dists:
                found.extend(ep for ep in dist.entry_points if ep.group == "gradseam")
            return metadata.EntryPoints(found)

        monkeypatch.setattr(metadata, "entry_points", entry_points)

    def add(self, dist: str, version: str, entry_points: dict[str, str], **modules: str) -> None:
        import importlib
        import textwrap
        from importlib import metadata

        info = self.dists_dir / f"{dist.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        (info / "entry_points.txt").write_text(
            "[gradseam]\n" + "".join(f"{name} = {value}\n" for name, value in entry_points.items())
        )
        for module, code in modules.items():
            (self.modules_dir / f"{module}.py").write_text(textwrap.dedent(code))
        importlib.invalidate_caches()
        self.dists.append(next(d for d in metadata.distributions(path=[str(info.parent)]) if d.name == dist))


def _builtin(ep) -> bool:
    """An entry point of gradseam's own distribution (the built-in families)."""
    dist = getattr(ep, "dist", None)
    return dist is not None and dist.name.replace("_", "-").lower() == "gradseam"


@pytest.fixture
def site(tmp_path, monkeypatch):
    monkeypatch.delenv("GRADSEAM_PLUGINS", raising=False)
    fake = FakeSite(tmp_path, monkeypatch)
    yield fake
    for name, module in list(sys.modules.items()):  # the next test may reuse a module name
        if str(getattr(module, "__file__", "") or "").startswith(str(fake.modules_dir)):
            del sys.modules[name]


def family_module(name: str, model: str = "", extra: str = "") -> str:
    """The source of a plugin module declaring one family by class names (no torch needed)."""
    model = model or f"{name}_pkg.Model"
    return f"""
        from gradseam.family import BlockClass, BlockList, Carry, Family
        from gradseam.hookspecs import hookimpl

        FAMILY = Family(
            name={name!r},
            models=({model!r},),
            block_lists=(BlockList("blocks", carry=Carry({{"hidden_states": None}})),),
            block_classes=(BlockClass("{name}_pkg.Block", ffn=(("ff",),), attention=("attn",)),),
        )

        @hookimpl
        def register_families(register):
            register(FAMILY)
        {extra}
        """


EMPTY = ([], [], [], [], False)


def test_third_party_entry_point_installs_with_its_distribution(site):
    site.add("gradseam-sd9", "1.2", {"sd9": "gs_sd9"}, gs_sd9=family_module("sd9"))
    registry = Registry()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        installed = {i.family.name: i for i in registry.installed()}
    assert sorted(installed) == sorted([*BUILTIN_FAMILIES, "sd9"])
    assert (installed["sd9"].plugin, installed["sd9"].distribution, installed["sd9"].version) == (
        "sd9", "gradseam-sd9", "1.2"
    )
    assert registry.failures() == []


BROKEN = {
    "import": ("raise ImportError('needs sd9-kernels')", "failed to import: ImportError: needs sd9-kernels"),
    "hook": (
        family_module("sd9", extra="@hookimpl\n        def register_families(register):\n            raise RuntimeError('no GPU')"),
        "failed in register_families: RuntimeError: no GPU",
    ),
    "non-family": (
        "from gradseam.hookspecs import hookimpl\n\n@hookimpl\ndef register_families(register):\n    register('sd9')\n",
        "called register() with str; expected a gradseam.family.Family.",
    ),
    "field": (
        family_module("sd9").replace("models=('sd9_pkg.Model',)", "models='sd9_pkg.Model'"),
        "failed to import: TypeError: Family 'sd9': field 'models' must be a tuple of model classes or their "
        "qualified names, got str 'sd9_pkg.Model'.",
    ),
    "misspelled": (
        "from gradseam.hookspecs import hookimpl\n\n@hookimpl\ndef register_family(register):\n    pass\n",
        "implements 'register_family' (did you mean 'register_families'?), which gradseam does not define;",
    ),
}


@pytest.mark.parametrize("kind", sorted(BROKEN))
def test_broken_third_party_plugin_is_skipped_with_a_warning(site, kind):
    code, cause = BROKEN[kind]
    site.add("gradseam-broken", "0.3", {"broken": "gs_broken"}, gs_broken=code)
    site.add("gradseam-sd8", "1.0", {"sd8": "gs_sd8"}, gs_sd8=family_module("sd8"))
    registry = Registry()
    with pytest.warns(PluginWarning) as record:
        names = [f.name for f in registry.families()]
    assert names == sorted([*BUILTIN_FAMILIES, "sd8"])  # the built-ins and the healthy plugin are unaffected
    messages = [str(w.message) for w in record if issubclass(w.category, PluginWarning)]
    assert len(messages) == 1
    prefix = "gradseam plugin 'broken' (distribution gradseam-broken 0.3, entry point broken = gs_broken) "
    assert messages[0].startswith(prefix + cause), messages[0]
    assert messages[0].endswith(
        "Skipped: its families are not installed, every other plugin's are. Fix or uninstall gradseam-broken, "
        "or leave it out with GRADSEAM_PLUGINS=name,name...; naming it in GRADSEAM_PLUGINS makes this an error."
    )
    assert record[0].filename == __file__  # attributed to the caller, not to gradseam's internals
    assert registry.failures() == [Failure("broken", "gradseam-broken", "0.3", messages[0])]
    assert not registry.pm.has_plugin("broken")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # loaded once: no second warning
        assert [f.name for f in registry.families()] == names


def test_broken_plugin_named_in_gradseam_plugins_raises_the_same_error_until_fixed(site, monkeypatch):
    site.add("gradseam-broken", "0.3", {"broken": "gs_broken"}, gs_broken=BROKEN["field"][0])
    monkeypatch.setenv("GRADSEAM_PLUGINS", "flux,broken")
    registry = Registry()
    errors = []
    for _ in range(2):
        with pytest.raises(TypeError) as info:
            registry.families()
        errors.append(str(info.value))
        assert state(registry) == EMPTY  # flux loaded fine, but nothing was committed
    assert errors[0] == errors[1]
    assert isinstance(info.value, gradseam.errors.PluginTypeError)
    assert (info.value.plugin, info.value.distribution) == ("broken", "gradseam-broken")
    assert errors[0].startswith(
        "gradseam plugin 'broken' (distribution gradseam-broken 0.3, entry point broken = gs_broken) failed to "
        "import: TypeError: Family 'sd9': field 'models'"
    )
    assert errors[0].endswith(
        "It is named in GRADSEAM_PLUGINS, so it is not skipped: fix or uninstall it, or leave it out of "
        "GRADSEAM_PLUGINS."
    )
    monkeypatch.setenv("GRADSEAM_PLUGINS", "flux")  # the failure was not latched: the next call loads
    assert [f.name for f in registry.families()] == ["flux"]


def test_warning_as_error_fails_the_same_way_each_time(site):
    site.add("gradseam-broken", "0.3", {"broken": "gs_broken"}, gs_broken=BROKEN["import"][0])
    registry = Registry()
    with warnings.catch_warnings():
        warnings.simplefilter("error", PluginWarning)
        for _ in range(2):
            with pytest.raises(PluginWarning, match="'broken'.*ImportError: needs sd9-kernels"):
                registry.families()
            assert state(registry) == EMPTY


def test_broken_builtin_plugin_raises(site):
    site.add("gradseam", "9.9", {"gone": "gs_gone"}, gs_gone="raise ImportError('half-installed')")
    site.builtins = False
    registry = Registry()
    with pytest.raises(gradseam.errors.PluginError) as info:
        registry.families()
    assert str(info.value) == (
        "gradseam plugin 'gone' (distribution gradseam 9.9, entry point gone = gs_gone) failed to import: "
        "ImportError: half-installed. This plugin is part of gradseam, so the installation is broken: reinstall "
        "gradseam."
    )
    assert state(registry) == EMPTY


def test_entry_point_named_like_a_builtin_is_a_conflict(site, monkeypatch):
    site.add("evil-flux", "2.0", {"flux": "gs_evil_flux"}, gs_evil_flux=family_module("evil"))
    registry = Registry()
    messages = []
    for _ in range(2):
        with pytest.raises(PluginConflictError) as info:
            registry.families()
        messages.append(str(info.value))
        assert state(registry) == EMPTY
    assert messages[0] == messages[1] == (
        f"gradseam plugin name 'flux' is declared by gradseam {gradseam.__version__} (flux = "
        "gradseam.adapters.flux) and by evil-flux 2.0 (flux = gs_evil_flux); one would silently replace the other "
        "depending on install order. Uninstall one of them (GRADSEAM_PLUGINS selects plugins by this name, so "
        "it cannot choose between them)."
    )
    assert "gs_evil_flux" not in sys.modules  # refused before importing either side
    monkeypatch.setenv("GRADSEAM_PLUGINS", "wan")  # a conflict among plugins not loaded does not matter
    assert [f.name for f in registry.families()] == ["wan"]


def test_two_third_party_distributions_with_one_entry_point_name(site):
    site.add("sd9-a", "1.0", {"sd9": "gs_sd9a"}, gs_sd9a=family_module("sd9a"))
    site.add("sd9-b", "2.0", {"sd9": "gs_sd9b"}, gs_sd9b=family_module("sd9b"))
    with pytest.raises(PluginConflictError) as info:
        Registry().families()
    assert "'sd9' is declared by sd9-a 1.0 (sd9 = gs_sd9a) and by sd9-b 2.0 (sd9 = gs_sd9b)" in str(info.value)
    assert (info.value.plugin, info.value.distribution) == ("sd9", "sd9-a, sd9-b")


def test_one_distribution_found_twice_is_one_plugin(site):
    site.add("gradseam-sd9", "1.2", {"sd9": "gs_sd9"}, gs_sd9=family_module("sd9"))
    site.dists.append(site.dists[-1])  # e.g. an install and a build tree, both on the path
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert "sd9" in [f.name for f in Registry().families()]


@pytest.mark.parametrize(
    ("family", "model", "expected"),
    [
        ("wan", "", "family 'wan' is registered by both plugin 'wan' (distribution gradseam {v}, entry point "
                    "wan = gradseam.adapters.wan) and plugin 'sd9' (distribution gradseam-sd9 1.2, entry point "
                    "sd9 = gs_sd9)."),
        ("sd9", "FluxTransformer2DModel",
         "model classes 'diffusers.models.transformers.transformer_flux.FluxTransformer2DModel' and "
         "'FluxTransformer2DModel' (a bare class name matches a class of that name from any module, so both "
         "name one class) are claimed by family 'flux' (plugin 'flux', distribution gradseam {v}, entry point "
         "flux = gradseam.adapters.flux) and family 'sd9' (plugin 'sd9', distribution gradseam-sd9 1.2, entry "
         "point sd9 = gs_sd9)."),
    ],
    ids=["family-name", "bare-model-class"],
)
def test_third_party_family_conflicting_with_a_builtin(site, family, model, expected):
    site.add("gradseam-sd9", "1.2", {"sd9": "gs_sd9"}, gs_sd9=family_module(family, model=model))
    registry = Registry()
    for _ in range(2):
        with pytest.raises(PluginConflictError) as info:
            registry.families()
        assert str(info.value) == (
            expected.format(v=gradseam.__version__)
            + " Uninstall one, or leave one out with GRADSEAM_PLUGINS=name,name... (the entry-point names)."
        )
        assert state(registry) == EMPTY


@pytest.mark.parametrize("value", ["", "  ", " , ,"])
def test_empty_gradseam_plugins_warns(site, monkeypatch, value):
    monkeypatch.setenv("GRADSEAM_PLUGINS", value)
    registry = Registry()
    with pytest.warns(PluginWarning) as record:
        assert registry.families() == []
    assert [str(w.message) for w in record] == [
        f"GRADSEAM_PLUGINS is set but names no plugin ({value!r}), so no gradseam plugin loads and no family is "
        f"installed. Unset it to load every installed plugin, or name the ones to load: {BUILTINS}."
    ]


def test_unknown_name_in_gradseam_plugins_warns(site, monkeypatch):
    monkeypatch.setenv("GRADSEAM_PLUGINS", "flux,no-such-plugin")
    with pytest.warns(PluginWarning) as record:
        assert [f.name for f in Registry().families()] == ["flux"]
    assert [str(w.message) for w in record] == [
        f"GRADSEAM_PLUGINS names ['no-such-plugin'], which no installed distribution provides; installed gradseam "
        f"plugins: {BUILTINS}."
    ]
