"""Which families are installed: a pluggy manager fed by the ``gradseam`` entry-point group.

Built-in adapters are found through the same entry points a third-party package declares, so
the core never names a family. ``GRADSEAM_PLUGINS`` (comma-separated entry-point names) limits
which entry points load, e.g. to rule out a misbehaving third-party plugin.

Every plugin is *staged* before anything is visible: imported, registered with the one pluggy
manager, its hooks called on it alone (``subset_hook_caller``), its families collected and checked
against each other and against what is installed. Only a load or registration that passed all of
that is committed, in one step (one :class:`_State` replaces the old one); anything that failed is
unregistered from the manager again. So a failure never leaves part of a plugin behind, and asking
again gives the same error.

What a failure does depends on whether gradseam can still answer correctly without the plugin:

* a **conflict** (two distributions declaring one entry-point name, two plugins registering one
  family name or one model class) always raises: which side would win depends on install order,
  and a model patched by the wrong declaration is a silent wrong result;
* a **third-party plugin that fails on its own** (import error, hook raising, an invalid
  declaration, a misspelled hook) is skipped with a :class:`~gradseam.errors.PluginWarning`:
  it provides nothing, the others are unaffected, and a model only it would handle is refused
  as unsupported. Named in ``GRADSEAM_PLUGINS`` it raises instead, as the user asked for it;
* a failing **built-in** plugin means gradseam itself is broken, and raises;
* a plugin passed to :func:`gradseam.register` raises to its caller.
"""

from __future__ import annotations

import difflib
import os
import re
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from importlib import metadata
from typing import Any

import pluggy

from . import hookspecs
from .errors import (
    PluginConflictError,
    PluginError,
    PluginTypeError,
    PluginValueError,
)
from .errors import warn_plugin as _warn  # at the first frame outside gradseam
from .family import Family, bare_name

ENTRY_POINT_GROUP = "gradseam"
PLUGINS_ENV = "GRADSEAM_PLUGINS"
BUILTIN_DISTRIBUTION = "gradseam"
# the hooks gradseam.hookspecs declares, read from it (a hook added there is known here at once)
_HOOKS = tuple(name for name, f in vars(hookspecs).items() if callable(f) and hasattr(f, f"{hookspecs.PROJECT}_spec"))

# The attention kernels gradseam knows without a plugin, as operator schema names: aten's kernels are
# what F.scaled_dot_product_attention and diffusers' "native" backends reach; the rest are the custom ops
# of libraries diffusers' attention dispatcher can use. Plugins add theirs (register_attention_kernels);
# attention_kernels() is the one place the whole set is assembled.
BUILTIN_KERNELS: frozenset[str] = frozenset(
    {
        "aten::_scaled_dot_product_flash_attention",
        "aten::_scaled_dot_product_flash_attention_for_cpu",
        "aten::_scaled_dot_product_efficient_attention",
        "aten::_scaled_dot_product_cudnn_attention",
        "aten::_scaled_dot_product_fused_attention_overrideable",
        "aten::_flash_attention_forward",
        "aten::_efficient_attention_forward",
        "flash_attn::_flash_attn_forward",
        "flash_attn::_flash_attn_varlen_forward",
        "_diffusers_flash_attn_3::_flash_attn_forward",
        "xformers_flash::flash_fwd",
        "xformers::efficient_attention_forward_cutlass",
    }
)


@dataclass(frozen=True)
class Installed:
    """A registered family and where it came from."""

    family: Family
    plugin: str
    distribution: str | None
    version: str | None


@dataclass(frozen=True)
class Failure:
    """A third-party plugin that was skipped, and why (the text of the warning it caused)."""

    plugin: str
    distribution: str | None
    version: str | None
    message: str


@dataclass(frozen=True)
class _Source:
    """Where a plugin comes from, for messages: its entry point and distribution, or the caller."""

    plugin: str
    distribution: str | None = None
    version: str | None = None
    value: str | None = None  # the entry point's "module:attr"; None for a runtime plugin

    @property
    def builtin(self) -> bool:
        return self.distribution is not None and _normalize(self.distribution) == BUILTIN_DISTRIBUTION

    def where(self) -> str:
        if self.value is None:
            return "registered at runtime"
        dist = f"distribution {self.distribution} {self.version}" if self.distribution else "unknown distribution"
        return f"{dist}, entry point {self.plugin} = {self.value}"

    def describe(self) -> str:
        return f"gradseam plugin {self.plugin!r} ({self.where()})"


@dataclass(frozen=True)
class _Staged:
    """One plugin as its hooks answered: what a commit makes visible."""

    source: _Source
    plugin: Any
    families: tuple[Family, ...]
    kernels: tuple[str, ...] = ()
    unsupported: tuple[tuple[str, str], ...] = ()  # (model class, why no family handles it)


class _State:
    """Everything registered: the plugins, and the two indexes read from them once per commit.

    Replaced whole, never edited in place, so a reader without the lock sees the old or the new
    state, never a mix; the indexes cannot disagree with the plugins because they are built from them.
    """

    def __init__(self, plugins: dict[str, _Staged] | None = None, failures: tuple[Failure, ...] = ()) -> None:
        self.plugins = dict(plugins or {})
        self.failures = failures
        self.families: dict[str, Installed] = {}
        self.by_model: dict[str, Installed] = {}
        for item in self.plugins.values():
            for family in item.families:
                installed = Installed(family, item.source.plugin, item.source.distribution, item.source.version)
                self.families[family.name] = installed
                self.by_model.update(dict.fromkeys(family.model_names, installed))
        self.kernels = BUILTIN_KERNELS.union(*(item.kernels for item in self.plugins.values()))
        self.unsupported: dict[str, str] = {model: reason for item in self.plugins.values()
                                            for model, reason in item.unsupported}

    def adding(self, staged: Iterable[_Staged]) -> _State:
        return _State({**self.plugins, **{item.source.plugin: item for item in staged}}, self.failures)

    def without(self, plugin: str) -> _State:
        return _State({k: v for k, v in self.plugins.items() if k != plugin}, self.failures)


class _Failed(Exception):
    """A staging failure; the caller decides whether it raises or is skipped, and adds the fix."""

    def __init__(self, source: _Source, message: str, cause: BaseException | None = None,
                 kind: type[PluginError] | None = None) -> None:
        super().__init__(message)
        self.source = source
        self.message = message
        self.cause = cause
        self.kind = kind

    def with_fix(self, fix: str) -> str:
        # the message may end with the plugin's own exception text, which need not end a sentence
        return f"{self.message}{'' if self.message.endswith(('.', '!', '?')) else '.'} {fix}"

    def error(self, fix: str) -> PluginError:
        kind = self.kind or _kind_of(self.cause)
        exc = kind(self.with_fix(fix), plugin=self.source.plugin, distribution=self.source.distribution)
        exc.__cause__ = self.cause
        return exc


def _kind_of(cause: BaseException | None) -> type[PluginError]:
    # Keep the built-in category of what the plugin raised, so `except TypeError` still catches a
    # plugin that passed a string where a tuple belongs.
    if isinstance(cause, TypeError):
        return PluginTypeError
    if isinstance(cause, ValueError):
        return PluginValueError
    return PluginError


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _same_class(a: str, b: str) -> bool:
    """Whether two class names can match one class: equal, or one bare and the last parts equal."""
    if a == b:
        return True
    return ("." not in a or "." not in b) and bare_name(a) == bare_name(b)


def _dist_of(ep: Any) -> tuple[str | None, str | None]:
    dist = getattr(ep, "dist", None)
    if dist is None:
        return None, None
    return dist.name, dist.version


class Registry:
    def __init__(self) -> None:
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self._lock = threading.RLock()
        self._loaded = False
        self._state = _State()

    # -- staging one plugin ----------------------------------------------------------------
    def _stage(self, plugin: Any, source: _Source) -> _Staged:
        """Register a plugin with the manager and collect what its hooks register (raises _Failed).

        Nothing is visible until :meth:`_commit`; on a failure the plugin is unregistered again.
        """
        taken = self.pm.get_name(plugin) if self.pm.is_registered(plugin) else None
        if taken is not None:
            raise PluginConflictError(  # a conflict: never skipped, whoever the plugin is
                f"plugins {taken!r} and {source.plugin!r} ({source.where()}) are the same object {plugin!r}; "
                "register it once.", plugin=source.plugin, distribution=source.distribution)
        try:
            self.pm.register(plugin, name=source.plugin)
        except pluggy.PluginValidationError as exc:
            raise _Failed(source, f"{source.describe()} has an invalid hook: {exc}. The hook is "
                          "`register_families(register)`; its parameter must be named `register`.",
                          exc, PluginTypeError) from None
        try:
            return self._collect(plugin, source)
        except BaseException:
            self.pm.unregister(name=source.plugin)
            raise

    def _collect(self, plugin: Any, source: _Source) -> _Staged:
        self._check_hook_names(plugin, source)
        others = [p for name, p in self.pm.list_name_plugin() if name != source.plugin]

        families: list[Family] = []

        def register(family: Family) -> None:
            if not isinstance(family, Family):
                raise _Failed(
                    source,
                    f"{source.describe()} called register() with {type(family).__name__}; expected a "
                    "gradseam.family.Family.",
                    kind=PluginTypeError,
                )
            families.append(family)

        kernels: list[str] = []

        def register_kernel(name: str) -> None:
            namespace, sep, op = name.partition("::") if isinstance(name, str) else ("", "", "")
            if not (sep and namespace and op):
                raise _Failed(
                    source,
                    f"{source.describe()} called register() in register_attention_kernels with {name!r}; "
                    "expected an operator's schema name such as 'mylib::attention'.",
                    kind=PluginTypeError,
                )
            kernels.append(name)

        unsupported: list[tuple[str, str]] = []

        def register_unsupported(model: str, reason: str) -> None:
            if not (isinstance(model, str) and "." in model.strip(".") and isinstance(reason, str) and reason.strip()):
                raise _Failed(
                    source,
                    f"{source.describe()} called register() in register_unsupported_models with {model!r}, "
                    f"{reason!r}; expected a model class's dotted path and a reason, such as "
                    "('mypkg.models.MyVAE', 'a VAE, not a transformer').",
                    kind=PluginTypeError,
                )
            unsupported.append((model, reason.strip().rstrip(".")))

        for hook, register_one in (("register_families", register),
                                   ("register_attention_kernels", register_kernel),
                                   ("register_unsupported_models", register_unsupported)):
            try:  # this plugin's implementation only: the others answered when they were staged
                self.pm.subset_hook_caller(hook, remove_plugins=others)(register=register_one)
            except _Failed:
                raise
            except Exception as exc:
                raise _Failed(
                    source, f"{source.describe()} failed in {hook}: {type(exc).__name__}: {exc}", exc
                ) from exc
        return _Staged(source, plugin, tuple(families), tuple(kernels), tuple(unsupported))

    def _check_hook_names(self, plugin: Any, source: _Source) -> None:
        # pluggy accepts a hookimpl for a hook nobody specified (it might be specified later) and
        # only complains in check_pending(); a misspelled hook would otherwise never be called.
        # Every plugin registered before this one passed the check, so what it finds is this one's.
        callers = self.pm.get_hookcallers(plugin) or []
        try:
            self.pm.check_pending()
        except pluggy.PluginValidationError as exc:
            unknown = sorted(caller.name for caller in callers if not caller.has_spec())
            hints = []
            for name in unknown:
                close = difflib.get_close_matches(name, _HOOKS, n=1, cutoff=0.6)
                hints.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
            raise _Failed(
                source,
                f"{source.describe()} implements {', '.join(hints)}, which gradseam does not define; "
                f"gradseam's hooks are {list(_HOOKS)}.",
                exc,
                PluginTypeError,
            ) from None
        if not any(caller.name in _HOOKS for caller in callers):
            undecorated = callable(getattr(plugin, "register_families", None))
            hint = (
                "its register_families is not decorated with @gradseam.hookimpl"
                if undecorated
                else "a plugin provides families through `@hookimpl def register_families(register)`"
            )
            raise _Failed(source, f"{source.describe()} implements no gradseam hook: {hint}.", kind=PluginTypeError)

    # -- checking a batch against the registry ----------------------------------------------
    def _check_conflicts(self, staged: list[_Staged], fix: str) -> None:
        """Raise if a staged family's name or model class is already taken (by the registry or the batch)."""
        state = self._state
        names: dict[str, tuple[Family, _Source]] = {
            n: (i.family, state.plugins[i.plugin].source) for n, i in state.families.items()
        }
        claims: list[tuple[str, Family, _Source]] = [
            (model, family, source) for family, source in names.values() for model in family.model_names
        ]
        for item in staged:
            for family in item.families:
                taken = names.get(family.name)
                if taken is not None:
                    _, other = taken
                    if other.plugin == item.source.plugin:
                        raise PluginConflictError(
                            f"{item.source.describe()} registers family {family.name!r} twice. {fix}",
                            plugin=item.source.plugin, distribution=item.source.distribution,
                        )
                    raise PluginConflictError(
                        f"family {family.name!r} is registered by both plugin {other.plugin!r} ({other.where()}) "
                        f"and plugin {item.source.plugin!r} ({item.source.where()}). {fix}",
                        plugin=item.source.plugin, distribution=item.source.distribution,
                    )
                for model in family.model_names:
                    for claimed, owner, other in claims:
                        if not _same_class(model, claimed):
                            continue
                        what = (
                            f"model class {model!r}" if model == claimed
                            else f"model classes {claimed!r} and {model!r} (a bare class name matches a "
                            "class of that name from any module, so both name one class)"
                        )
                        raise PluginConflictError(
                            f"{what} {'is' if model == claimed else 'are'} claimed by family {owner.name!r} "
                            f"(plugin {other.plugin!r}, {other.where()}) and family {family.name!r} "
                            f"(plugin {item.source.plugin!r}, {item.source.where()}). {fix}",
                            plugin=item.source.plugin, distribution=item.source.distribution,
                        )
                names[family.name] = (family, item.source)
                claims.extend((model, family, item.source) for model in family.model_names)

    def _commit(self, staged: list[_Staged], failures: list[Failure] | None = None) -> None:
        state = self._state.adding(staged)
        if failures is not None:
            state.failures = tuple(failures)
        self._state = state

    def _abandon(self, staged: list[_Staged]) -> None:
        """Unregister staged plugins that will not be committed (a conflict in their batch)."""
        for item in staged:
            if self.pm.has_plugin(item.source.plugin):
                self.pm.unregister(name=item.source.plugin)

    # -- loading the entry points -----------------------------------------------------------
    @staticmethod
    def _entry_points() -> list[list[Any]]:
        """The group's entry points grouped by name; a group of two or more is a conflict.

        Built-ins first, then by name: a fixed order makes a conflict read the same on every machine,
        with the built-in as the side that was there first.
        """
        by_name: dict[str, list[Any]] = {}
        for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
            same = by_name.setdefault(ep.name, [])
            dist = _normalize(_dist_of(ep)[0] or "")
            # one distribution found twice on the path (say, an install and a build tree) is one plugin
            if not any(o.value == ep.value and _normalize(_dist_of(o)[0] or "") == dist for o in same):
                same.append(ep)

        def builtin(ep: Any) -> bool:
            return _normalize(_dist_of(ep)[0] or "") == BUILTIN_DISTRIBUTION

        return sorted(by_name.values(), key=lambda points: (not all(map(builtin, points)), points[0].name))

    @staticmethod
    def _name_conflict(points: list[Any]) -> PluginConflictError:
        sides = []
        for ep in points:
            dist, version = _dist_of(ep)
            sides.append(f"{f'{dist} {version}' if dist else 'an unknown distribution'} ({ep.name} = {ep.value})")
        return PluginConflictError(
            f"gradseam plugin name {points[0].name!r} is declared by {' and by '.join(sides)}; one would "
            f"silently replace the other depending on install order. Uninstall one of them ({PLUGINS_ENV} "
            "selects plugins by this name, so it cannot choose between them).",
            plugin=points[0].name,
            distribution=", ".join(str(_dist_of(ep)[0]) for ep in points),
        )

    def _allowed(self, available: Iterable[str]) -> set[str] | None:
        raw = os.environ.get(PLUGINS_ENV)
        if raw is None:
            return None
        allowed = {name.strip() for name in raw.split(",") if name.strip()}
        if not allowed:
            _warn(
                f"{PLUGINS_ENV} is set but names no plugin ({raw!r}), so no gradseam plugin loads and no "
                f"family is installed. Unset it to load every installed plugin, or name the ones to load: "
                f"{sorted(available)}."
            )
        return allowed

    def _load_entry_points(self) -> None:
        groups = self._entry_points()
        names = [points[0].name for points in groups]
        allowed = self._allowed(names)
        if allowed is not None:
            unknown = sorted(allowed - set(names))
            if unknown:
                _warn(
                    f"{PLUGINS_ENV} names {unknown}, which no installed distribution provides; "
                    f"installed gradseam plugins: {sorted(names)}."
                )
        staged: list[_Staged] = []
        try:
            self._stage_all(groups, allowed, staged)
        except BaseException:
            self._abandon(staged)
            raise

    def _stage_all(self, groups: list[list[Any]], allowed: set[str] | None, staged: list[_Staged]) -> None:
        skipped: list[_Failed] = []
        for points in groups:
            point, name = points[0], points[0].name
            if allowed is not None and name not in allowed:
                continue
            if len(points) > 1:
                raise self._name_conflict(points)
            source = _Source(name, *_dist_of(point), value=point.value)
            try:
                try:
                    plugin = point.load()
                except Exception as exc:
                    raise _Failed(source, f"{source.describe()} failed to import: {type(exc).__name__}: {exc}",
                                  exc) from exc
                staged.append(self._stage(plugin, source))
            except _Failed as failed:
                if source.builtin:
                    raise failed.error(
                        "This plugin is part of gradseam, so the installation is broken: reinstall gradseam."
                    ) from failed.cause
                if allowed is not None:
                    raise failed.error(
                        f"It is named in {PLUGINS_ENV}, so it is not skipped: fix or uninstall it, or leave "
                        f"it out of {PLUGINS_ENV}."
                    ) from failed.cause
                skipped.append(failed)
        self._check_conflicts(
            staged, f"Uninstall one, or leave one out with {PLUGINS_ENV}=name,name... (the entry-point names)."
        )
        failures = []
        for failed in skipped:
            dist = failed.source.distribution or "it"
            message = failed.with_fix(
                f"Skipped: its families are not installed, every other plugin's are. Fix or uninstall {dist}, "
                f"or leave it out with {PLUGINS_ENV}=name,name...; naming it in {PLUGINS_ENV} makes this an error."
            )
            # warned before committing: under `-W error` the load fails, and fails the same way again
            _warn(message)
            failures.append(Failure(failed.source.plugin, failed.source.distribution, failed.source.version, message))
        self._commit(staged, failures)

    def ensure_loaded(self) -> None:
        if self._loaded:
            return
        with self._lock:
            if self._loaded:
                return
            self._load_entry_points()  # raises before committing anything; then the next call retries
            self._loaded = True

    # -- public operations -----------------------------------------------------------------
    def register(self, plugin: Any, name: str | None = None) -> str:
        """Register a plugin object at runtime: all of its families, or (on any error) none of them."""
        self.ensure_loaded()
        with self._lock:
            if name is not None and (not isinstance(name, str) or not name):
                raise PluginTypeError(f"a plugin name must be a non-empty str, got {name!r}.")
            plugin_name = name or self.pm.get_canonical_name(plugin)
            # pluggy raises a bare ValueError for a taken name or object; say it as a plugin conflict
            if self.pm.has_plugin(plugin_name) or self.pm.is_registered(plugin):
                taken = self.pm.get_name(plugin) if self.pm.is_registered(plugin) else plugin_name
                raise PluginConflictError(f"plugin {taken!r} is already registered.", plugin=plugin_name)
            source = _Source(plugin_name)
            try:
                staged = self._stage(plugin, source)
            except _Failed as failed:
                raise failed.error("Nothing of it was registered.") from failed.cause
            try:
                self._check_conflicts(
                    [staged],
                    f"Nothing of plugin {plugin_name!r} was registered. Unregister the other plugin, or leave an "
                    f"installed one out with {PLUGINS_ENV}=name,name...",
                )
            except BaseException:
                self._abandon([staged])
                raise
            self._commit([staged])
            return plugin_name

    def unregister(self, name: str) -> None:
        with self._lock:
            self._drop(name)

    def _drop(self, plugin_name: str) -> None:
        if self.pm.has_plugin(plugin_name):
            self.pm.unregister(name=plugin_name)
        self._state = self._state.without(plugin_name)

    def installed(self) -> list[Installed]:
        self.ensure_loaded()
        return sorted(self._state.families.values(), key=lambda i: i.family.name)

    def families(self) -> list[Family]:
        return [i.family for i in self.installed()]

    def attention_kernels(self) -> frozenset[str]:
        """Operator names that count as attention kernels: the built-in ones and every plugin's."""
        self.ensure_loaded()
        return self._state.kernels

    def failures(self) -> list[Failure]:
        """Third-party plugins skipped at load time (each also gave a PluginWarning)."""
        self.ensure_loaded()
        return list(self._state.failures)

    def get(self, name: str) -> Family:
        self.ensure_loaded()
        try:
            return self._state.families[name].family
        except KeyError:
            raise KeyError(f"no family named {name!r}; installed: {sorted(self._state.families)}") from None

    def for_model_type(self, model_type: type) -> Family | None:
        """The family that handles a model class (or one of its bases)."""
        self.ensure_loaded()
        by_model = self._state.by_model
        for klass in model_type.__mro__:
            # A full dotted name first; a bare class name (declared without a module) matches any module,
            # for classes whose home module is not settled upstream yet. Registration rejects a bare
            # and a full claim of one name by different families, so at most one of the two is found.
            found = by_model.get(f"{klass.__module__}.{klass.__qualname__}") or by_model.get(klass.__qualname__)
            if found is not None:
                return found.family
        return None

    def unsupported_reason(self, model_type: type) -> str | None:
        """Why no family handles this model class, if a plugin said so
        (:func:`gradseam.hookspecs.register_unsupported_models`); None when none did. The class itself only,
        not its bases: a subclass may be another model (a legacy generic class is the base of real ones)."""
        self.ensure_loaded()
        return self._state.unsupported.get(f"{model_type.__module__}.{model_type.__qualname__}")

    def unsupported_models(self) -> dict[str, str]:
        """Every model class a plugin named as left out, with its reason, sorted by class path; a class an
        installed family claims is not left out (that family handles it: a plugin's family for a class gradseam
        leaves out takes precedence), so it is not listed."""
        self.ensure_loaded()
        by_model = self._state.by_model
        return {path: why for path, why in sorted(self._state.unsupported.items())
                if path not in by_model and path.rpartition(".")[2] not in by_model}

    def reset(self) -> None:
        """Forget everything and reload lazily (tests, or after installing a plugin in-process)."""
        with self._lock:
            for name, _ in list(self.pm.list_name_plugin()):
                self.pm.unregister(name=name)
            self._state = _State()
            self._loaded = False


REGISTRY = Registry()
