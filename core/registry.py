"""Which families are installed: a pluggy manager fed by the ``gradseam`` entry-point group.

Built-in adapters are found through the same entry points a third-party package declares, so
the core never names a family. ``GRADSEAM_PLUGINS`` (comma-separated entry-point names) limits
which entry points load, e.g. to rule out a misbehaving third-party plugin.
"""

from __future__ import annotations

import os
import threading
import warnings
from dataclasses import dataclass
from importlib import metadata
from typing import Any

import pluggy

from . import hookspecs
from .errors import GradseamError, PluginConflictError
from .family import Family

ENTRY_POINT_GROUP = "gradseam"
PLUGINS_ENV = "GRADSEAM_PLUGINS"


@dataclass(frozen=True)
class Installed:
    """A registered family and where it came from."""

    family: Family
    plugin: str
    distribution: str | None
    version: str | None


class Registry:
    def __init__(self) -> None:
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self._lock = threading.Lock()
        self._loaded = False
        self._families: dict[str, Installed] = {}
        self._by_model: dict[str, Installed] = {}
        self._dists: dict[str, tuple[str | None, str | None]] = {}

    # -- loading ---------------------------------------------------------------------------
    def _allowed(self) -> set[str] | None:
        raw = os.environ.get(PLUGINS_ENV)
        if raw is None:
            return None
        return {name.strip() for name in raw.split(",") if name.strip()}

    def _load_entry_points(self) -> None:
        allowed = self._allowed()
        points = list(metadata.entry_points(group=ENTRY_POINT_GROUP))
        if allowed is not None:
            unknown = sorted(allowed - {ep.name for ep in points})
            if unknown:
                warnings.warn(
                    f"{PLUGINS_ENV} names {unknown}, which no installed distribution provides; "
                    f"installed gradseam plugins: {sorted(ep.name for ep in points)}.",
                    RuntimeWarning,
                    stacklevel=4,
                )
        for ep in points:
            if allowed is not None and ep.name not in allowed:
                continue
            if self.pm.has_plugin(ep.name):
                continue
            try:
                plugin = ep.load()
            except Exception as exc:
                dist = getattr(getattr(ep, "dist", None), "name", "an unknown distribution")
                raise GradseamError(
                    f"gradseam plugin {ep.name!r} (from {dist}, {ep.value}) failed to import: "
                    f"{type(exc).__name__}: {exc}. Fix or uninstall it, or load only the plugins you "
                    f"need with {PLUGINS_ENV}=name,name..."
                ) from exc
            self.pm.register(plugin, name=ep.name)
            dist = getattr(ep, "dist", None)
            self._dists[ep.name] = (dist.name, dist.version) if dist is not None else (None, None)

    def _collect(self, plugin_name: str) -> None:
        # Call each plugin's hook on its own, so every family knows which plugin declared it.
        for impl in self.pm.hook.register_families.get_hookimpls():
            if impl.plugin_name != plugin_name:
                continue

            def register(family: Family) -> None:
                self._add(family, plugin_name)

            impl.function(register=register)

    def _add(self, family: Family, plugin_name: str) -> None:
        if not isinstance(family, Family):
            raise TypeError(
                f"plugin {plugin_name!r} called register() with {type(family).__name__}; "
                "expected a gradseam.family.Family."
            )
        dist, version = self._dists.get(plugin_name, (None, None))
        installed = Installed(family, plugin_name, dist, version)
        other = self._families.get(family.name)
        if other is not None:
            raise PluginConflictError(
                f"family {family.name!r} is registered by both plugin {other.plugin!r} and plugin "
                f"{plugin_name!r}; uninstall one, or restrict loading with {PLUGINS_ENV}=..."
            )
        for model in family.model_names:
            other = self._by_model.get(model)
            if other is not None:
                raise PluginConflictError(
                    f"model class {model!r} is claimed by family {other.family.name!r} (plugin "
                    f"{other.plugin!r}) and family {family.name!r} (plugin {plugin_name!r}); "
                    f"uninstall one, or restrict loading with {PLUGINS_ENV}=..."
                )
        self._families[family.name] = installed
        for model in family.model_names:
            self._by_model[model] = installed

    def ensure_loaded(self) -> None:
        with self._lock:
            if self._loaded:
                return
            self._load_entry_points()
            for name, _plugin in self.pm.list_name_plugin():
                self._collect(name)
            self._loaded = True

    # -- public operations -----------------------------------------------------------------
    def register(self, plugin: Any, name: str | None = None) -> str:
        """Register a plugin object at runtime (its families are added at once)."""
        self.ensure_loaded()
        with self._lock:
            # pluggy raises a bare ValueError for a taken name or object; say it as a plugin conflict
            if (name is not None and self.pm.has_plugin(name)) or self.pm.is_registered(plugin):
                raise PluginConflictError(f"plugin {name or plugin!r} is already registered.")
            plugin_name = self.pm.register(plugin, name=name)
            if plugin_name is None:
                raise PluginConflictError(f"plugin {name or plugin!r} is already registered.")
            try:
                self._collect(plugin_name)
            except Exception:
                self._drop(plugin_name)
                raise
            return plugin_name

    def unregister(self, name: str) -> None:
        with self._lock:
            self._drop(name)

    def _drop(self, plugin_name: str) -> None:
        if self.pm.has_plugin(plugin_name):
            self.pm.unregister(name=plugin_name)
        for key in [k for k, v in self._families.items() if v.plugin == plugin_name]:
            del self._families[key]
        for key in [k for k, v in self._by_model.items() if v.plugin == plugin_name]:
            del self._by_model[key]

    def installed(self) -> list[Installed]:
        self.ensure_loaded()
        return sorted(self._families.values(), key=lambda i: i.family.name)

    def families(self) -> list[Family]:
        return [i.family for i in self.installed()]

    def get(self, name: str) -> Family:
        self.ensure_loaded()
        try:
            return self._families[name].family
        except KeyError:
            raise KeyError(f"no family named {name!r}; installed: {sorted(self._families)}") from None

    def for_model_type(self, model_type: type) -> Family | None:
        """The family that handles a model class (or one of its bases)."""
        self.ensure_loaded()
        for klass in model_type.__mro__:
            # A full dotted name first; a bare class name (declared without a module) matches any module,
            # for classes whose home module is not settled upstream yet.
            found = self._by_model.get(f"{klass.__module__}.{klass.__qualname__}") or self._by_model.get(
                klass.__qualname__
            )
            if found is not None:
                return found.family
        return None

    def reset(self) -> None:
        """Forget everything and reload lazily (tests, or after installing a plugin in-process)."""
        with self._lock:
            for name, _ in list(self.pm.list_name_plugin()):
                self.pm.unregister(name=name)
            self._families.clear()
            self._by_model.clear()
            self._dists.clear()
            self._loaded = False


REGISTRY = Registry()
