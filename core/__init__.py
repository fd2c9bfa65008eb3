"""gradseam: gradient checkpointing and activation offload for diffusers transformers.

``import gradseam`` stays cheap: torch and diffusers load only when a model is patched.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .config import BACKENDS, CheckpointConfig
from .errors import (
    ConfigFileNotFoundError,
    GradseamError,
    PluginConflictError,
    UnsupportedModelError,
    UnsupportedStrategyError,
)
from .family import BlockClass, BlockList, Carry, Family, Preset
from .hookspecs import hookimpl

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    from .handle import PatchHandle, PipelineHandle
    from .registry import Installed
    from .tools.advise import Advice

__version__ = "0.1.0"


def _plan_auto(request: Any) -> Any:
    """``gradient_checkpointing_backend: "auto"``'s planner, a tool (it measures): loaded on first use and handed
    to the runtime here, since the runtime never imports the tools (:mod:`gradseam.auto`)."""
    from .tools.auto_planner import plan

    return plan(request)


from .auto import use_planner as _use_planner  # noqa: E402 - after __version__, which the planner's cache key reads

_use_planner(_plan_auto)

__all__ = [
    "BACKENDS",
    "BlockClass",
    "BlockList",
    "Carry",
    "CheckpointConfig",
    "ConfigFileNotFoundError",
    "Family",
    "GradseamError",
    "PluginConflictError",
    "Preset",
    "UnsupportedModelError",
    "UnsupportedStrategyError",
    "advise",
    "families",
    "handle_of",
    "handles",
    "hookimpl",
    "installed",
    "patch",
    "patching",
    "register",
    "unregister",
    "unsupported_models",
]


def patch(target: Any, config: Any = None, **kwargs: Any) -> PatchHandle | PipelineHandle:
    """Patch a diffusers model (or every supported component of a pipeline).

    ``config`` is a :class:`CheckpointConfig`, a mapping of the config keys, the path of a JSON
    config file, or omitted in favour of keyword arguments (which override it key by key). The keys
    are merged as given and resolved once, so any mix gives the config of the same keys in one dict
    (:meth:`CheckpointConfig.coerce`). Anything else (``True``, ``0``, a list) is a ``TypeError``
    rather than a silent fall back to the defaults, and every keyword is read as a config key: to
    pick the gradseam keys out of a whole trainer config, pass
    ``CheckpointConfig.from_dict(trainer_config, ignore_unknown=True)`` as ``config``. A path that
    names no file is a :class:`ConfigFileNotFoundError` (a ``FileNotFoundError``).

    A model inside a thin wrapper (PEFT's ``PeftModel``, ``DistributedDataParallel`` and other
    wrappers holding it as ``.module``) is unwrapped: the diffusers model inside is patched.
    Returns a handle whose ``remove()`` restores the model exactly.
    """
    from .patcher import patch as _patch

    return _patch(target, config, **kwargs)


def advise(model: Any, example_inputs: Any, *args: Any, **kwargs: Any) -> Advice:
    """The fastest strategy that fits ``gpu`` (GPU memory, e.g. ``"40GiB"``) at the model's real depth (see
    :func:`gradseam.tools.advise.advise`, which takes the same arguments).

    Loaded on first use: the runtime never imports the tools that measure and advise.
    """
    from .tools.advise import advise as _advise

    return _advise(model, example_inputs, *args, **kwargs)


def handle_of(model: Any) -> PatchHandle | None:
    """The active patch handle of a model (or of the model inside a wrapper ``patch`` unwraps), or None."""
    from .handle import handle_of as _handle_of
    from .patcher import unwrap_model

    return _handle_of(unwrap_model(model)[0]) if _is_module(model) else None


def _is_module(value: Any) -> bool:
    import torch

    return isinstance(value, torch.nn.Module)


def patching(config: Any = None, **kwargs: Any) -> AbstractContextManager[list[PatchHandle]]:
    """Patch every diffusers model loaded inside the block (``from_pretrained``, ``from_single_file``).

    ``with gradseam.patching(config): pipe = FluxPipeline.from_pretrained(...)`` patches each loaded
    model or pipeline component an installed family handles, and leaves the rest alone. Leaving the
    block restores the loaders; the models keep their patches. Yields the handles made in the block.
    ``on_patch=callback`` is called as ``callback(handle, component)`` after each model is patched
    (``component``: the pipeline attribute, or None), for callers that never see the loaded object.
    """
    from .loading import patching as _patching

    return _patching(config, **kwargs)


def handles(target: Any) -> PatchHandle | PipelineHandle | None:
    """The handle of a patched model, a handle over a pipeline's patched components, or None."""
    from .loading import handles as _handles

    return _handles(target)


def families() -> list[Family]:
    """The installed families (built-in and third-party), sorted by name."""
    from .registry import REGISTRY

    return REGISTRY.families()


def installed() -> list[Installed]:
    """Installed families with the plugin and distribution that provide each."""
    from .registry import REGISTRY

    return REGISTRY.installed()


def unsupported_models() -> dict[str, str]:
    """Model classes the installed plugins name as left out (no family will handle them), each with why."""
    from .registry import REGISTRY

    return REGISTRY.unsupported_models()


def register(plugin: Any, name: str | None = None) -> str:
    """Register a plugin object (module or instance with ``@hookimpl`` functions) at runtime."""
    from .registry import REGISTRY

    return REGISTRY.register(plugin, name=name)


def unregister(name: str) -> None:
    """Remove a plugin registered at runtime, with its families."""
    from .registry import REGISTRY

    REGISTRY.unregister(name)
