"""``gradseam.patch``: resolve a model's family, plan its regions, install them, and undo it all.

The plan (:mod:`gradseam.planning`) is computed first and only then installed, so a refused
configuration raises before the model is touched. The handle (:mod:`gradseam.handle`) owns what
was installed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from .config import CheckpointConfig
from .errors import PLUGIN_GUIDE, UnsupportedModelError, UnsupportedStrategyError
from .family import Family
from .handle import PatchHandle, PipelineHandle, handle_of, model_device
from .planning import (  # noqa: F401 - GradseamWarning and warned are re-exported for callers of this module
    GradseamWarning,
    plan,
    resolve,
    unwrap,
    warn_once,
    warned,
)
from .registry import REGISTRY
from .spec import Plan, RegionSpec  # noqa: F401 - re-exported for callers of this module
from .summary import RegionView

__all__ = ["PatchHandle", "PipelineHandle", "RegionView", "family_for", "handle_of", "patch", "patch_model",
           "patch_models"]


def _check_offload_device(model: nn.Module, config: CheckpointConfig, planned: Plan) -> None:
    from .offload import cpu_allowed

    wants = planned.strategy.offloaded()
    if wants and planned.needs_engine and model_device(model) == "cpu" and not cpu_allowed():
        raise UnsupportedStrategyError(
            f"{' and '.join(wants)} {'moves' if len(wants) == 1 else 'move'} activations from GPU to CPU "
            f"memory and {'needs' if len(wants) == 1 else 'need'} a CUDA model, but "
            f"{type(model).__name__} is on the CPU. Move the model to a GPU first (model.to('cuda')), "
            "or use backend 'torch' / 'torch-ffn' on the CPU."
        )


def family_for(model: nn.Module) -> Family:
    family = REGISTRY.for_model_type(type(model))
    if family is None:
        installed = ", ".join(f.name for f in REGISTRY.families()) or "none"
        raise UnsupportedModelError(
            f"no gradseam family handles {type(model).__module__}.{type(model).__qualname__}. "
            f"Installed families: {installed}. To support it, install or write a plugin: see {PLUGIN_GUIDE}."
        )
    return family


def patch_models(
    models: Mapping[str, nn.Module], config: CheckpointConfig, *, check_device: bool = True
) -> dict[str, PatchHandle]:
    """Patch several models all-or-nothing: every plan and device check passes before any is installed.

    check_device=False: load-time patching (gradseam.patching), where loaders build models on the
    CPU before the user moves them; the offload engine only moves CUDA tensors, so that is safe,
    and the handle says offload is pending until the model is on a GPU.
    """
    plans = {name: plan(model, family_for(model), config) for name, model in models.items()}
    if check_device:
        for name, model in models.items():
            _check_offload_device(model, config, plans[name])
    done: dict[str, PatchHandle] = {}
    replaced: list[PatchHandle] = []
    try:
        for name, model in models.items():
            previous = handle_of(model)
            if previous is not None:
                previous.remove()  # a second patch replaces the first, never stacks
                replaced.append(previous)
            handle = PatchHandle(model, plans[name])
            handle.deferred_device = not check_device
            handle._install()
            done[name] = handle
    except BaseException:
        for handle in done.values():
            handle.remove()
        for previous in replaced:  # put back what the failed patch replaced
            previous.plan = plan(previous.model, previous.family, previous.config)
            previous._install()
        raise
    return done


def patch_model(model: nn.Module, config: CheckpointConfig, *, check_device: bool = True) -> PatchHandle:
    return patch_models({"model": model}, config, check_device=check_device)["model"]


def pipeline_components(target: Any) -> dict[str, nn.Module] | None:
    components = getattr(target, "components", None)
    if not isinstance(components, Mapping) or isinstance(target, nn.Module):
        return None
    return {name: c for name, c in components.items() if isinstance(c, nn.Module)}


def patch(
    target: Any, config: CheckpointConfig | Mapping[str, Any] | None = None, **kwargs: Any
) -> PatchHandle | PipelineHandle:
    """Patch a diffusers model, or every supported component of a pipeline, with ``config``."""
    cfg = CheckpointConfig.coerce(config, **kwargs)
    cfg.warn_if_idle("gradseam.patch")
    components = pipeline_components(target)
    if components is None:
        if not isinstance(target, nn.Module):
            raise TypeError(f"gradseam.patch expects a diffusers model or pipeline, got {type(target).__name__}.")
        return patch_model(target, cfg)
    supported = {n: m for n, m in components.items() if REGISTRY.for_model_type(type(m)) is not None}
    if not supported:
        installed = ", ".join(f.name for f in REGISTRY.families()) or "none"
        kinds = ", ".join(f"{n}={type(m).__name__}" for n, m in components.items())
        raise UnsupportedModelError(
            f"no component of {type(target).__name__} is handled by an installed gradseam family "
            f"(components: {kinds}; installed families: {installed}). See {PLUGIN_GUIDE}."
        )
    return PipelineHandle(target, patch_models(supported, cfg))


