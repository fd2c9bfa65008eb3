"""``gradseam.patch``: resolve a model's family, plan its regions, install them, and undo it all.

The plan (:mod:`gradseam.planning`) is computed first and only then installed, so a refused
configuration raises before the model is touched. The handle (:mod:`gradseam.handle`) owns what
was installed.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

from torch import nn

from .auto import UNPLANNED, UNPLANNED_STREAMED, AutoPlanning, unplanned
from .config import AUTO, CheckpointConfig
from .errors import PLUGIN_GUIDE, UnsupportedModelError, UnsupportedStrategyError, warn_once
from .family import Family
from .handle import PatchHandle, PipelineHandle, handle_of
from .kinds import staying_sibling
from .modules import device_type, gpu_limit_bytes, is_optimized, resolve
from .planning import plan
from .registry import REGISTRY
from .spec import Plan

__all__ = ["family_for", "patch", "patch_model", "patch_models", "unwrap_model"]


def _cpu_instead(planned: Plan) -> str:
    """What runs on a CPU model instead of what offloads: the backend's sibling that keeps its scope and
    runner but offloads nothing (``unsloth`` -> ``torch``, ``unsloth-ffn`` -> ``torch-ffn``,
    ``unsloth-compile`` -> ``compile``), and attention offload left out."""
    steps = []
    strategy = planned.strategy
    backend = strategy.backend
    if backend is not None and backend.moves:
        sibling = staying_sibling(backend).name
        steps.append(f"backend {sibling!r} (what {backend.name!r} does, keeping its activations in the model's memory)")
    if strategy.attention_offload:
        steps.append("no gradient_checkpointing_offload_attention"
                     + (" (gradient_checkpointing_keep_attention keeps the kernel outputs in the model's memory instead)"
                        if strategy.kind is not None and strategy.kind.keeps_kernels else ""))
    return " and ".join(steps)


GROUP_OFFLOADING = "group_offloading"  # the name diffusers registers its group-offloading hooks under


def _group_offloaded(model: nn.Module) -> bool:
    """Whether diffusers' group offloading (``enable_group_offload`` / ``apply_group_offloading``) moves this
    model's weights: it registers a hook of that name on the model and on each group it moves."""
    return any(GROUP_OFFLOADING in getattr(getattr(m, "_diffusers_hook", None), "hooks", {}) for m in model.modules())


def _check_group_offloading(model: nn.Module, planned: Plan) -> None:
    """Group offloading keeps the weights in CPU memory between uses, so weight streaming would move the same
    weights a second way: refused, naming it (the offload backends' conflict is :func:`_check_offload_device`'s)."""
    if planned.streamed and _group_offloaded(model):
        raise UnsupportedStrategyError(
            f"{type(model).__name__} has diffusers' group offloading on, which already moves its weights between "
            "CPU and GPU memory; gradient_checkpointing_stream_weights would move the same weights a second way. "
            "Use one: load the model without group offloading and keep the key (it copies the frozen weights in per "
            "block on a side stream, releases them in backward too, and keeps the LoRA on the GPU), or leave the "
            "key out."
        )


def _check_offload_device(model: nn.Module, config: CheckpointConfig, planned: Plan) -> None:
    from .offload import cpu_allowed

    wants = planned.offloaded()
    # a model whose weights stream is patched on the CPU on purpose (its weights may not fit the GPU):
    # the handle says offload is pending until model.to("cuda"), as for a model patched at load time
    if wants and planned.stores and not planned.streamed and device_type(model) == "cpu" and not cpu_allowed():
        one = len(wants) == 1
        needs = (f"{' and '.join(wants)} {'moves' if one else 'move'} activations from GPU to CPU memory and "
                 f"{'needs' if one else 'need'} a CUDA model, but {type(model).__name__}")
        if _group_offloaded(model):  # its weights are in CPU memory between uses, however it runs
            raise UnsupportedStrategyError(
                f"{needs} has diffusers' group offloading on, which keeps its weights in CPU memory between uses. "
                "For weights that do not fit the GPU, load it without group offloading and set "
                "gradient_checkpointing_stream_weights (gradseam's own streaming, which composes with every "
                f"backend); or keep group offloading with {_cpu_instead(planned)}."
            )
        raise UnsupportedStrategyError(
            f"{needs} is on the CPU. Move the model to a GPU first (model.to('cuda')), or on the CPU use "
            f"{_cpu_instead(planned)}."
        )


def _warn_if_the_gpu_cannot_hold_what_stays(model: nn.Module, planned: Plan) -> None:
    """A model on the CPU whose plan streams some blocks' weights, and whose weights left resident are already more
    than the GPU may hold, runs out of memory when it moves there, before any step, with an error from deep in
    ``Module.to`` that names neither the key nor the fix: said here, once, with both. Not known yet (so not said) for
    a base not frozen at patch time: what streams is chosen at the first move (load-time patching)."""
    if not planned.streamed or device_type(model) != "cpu" or (limit := gpu_limit_bytes()) is None:
        return
    from .offload.weights import streamable

    def frozen_bytes(block: nn.Module) -> int:
        return sum(t.numel() * t.element_size() for *_, t in streamable(block))

    every = [block for bl in planned.family.block_lists
             if isinstance(found := resolve(model, bl.path), nn.ModuleList) for block in found]
    blocks = [resolve(model, path)[index] for path, index in planned.streamed]
    if not all(any(not p.requires_grad for p in block.parameters()) for block in blocks):
        return
    total = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    resident = total - sum(frozen_bytes(block) for block in blocks)
    if resident <= limit:
        return
    gib = 2**30
    least = total - sum(frozen_bytes(block) for block in every)
    if planned.config is UNPLANNED_STREAMED:
        why = "gradient_checkpointing_backend \"auto\" streams every block's until it is planned"
    else:
        why = f"gradient_checkpointing_stream_weights={planned.config.gradient_checkpointing_stream_weights!r}"
    fix = (f"Stream more blocks (\"all\" leaves {least / gib:.2f} GiB there), or let gradient_checkpointing_backend "
           "\"auto\" choose with gradient_checkpointing_gpu_memory set" if least <= limit else
           "Even with every block's streamed that much stays: quantize the base, or use a larger GPU")
    warn_once(
        f"gradseam: {type(model).__name__} streams the frozen weights of {len(blocks)} of its {len(every)} blocks "
        f"({why}), which leaves {resident / gib:.2f} GiB of its {total / gib:.2f} GiB of weights and buffers for the "
        f"GPU, more than the {limit / gib:.2f} GiB this process may allocate on its CUDA device: moving it there will "
        f"run out of memory before a step runs. {fix}.")


def _handled(module: Any) -> bool:
    return isinstance(module, nn.Module) and REGISTRY.for_model_type(type(module)) is not None


def _wrapped(module: nn.Module) -> tuple[str, nn.Module] | None:
    """The module a thin wrapper holds, with the attribute path to it, or None for anything else:
    PEFT's ``PeftModel`` (``base_model.model``) and its tuner (``LoraModel.model``), and wrappers
    that hold the model as their ``module`` submodule (torch's ``DistributedDataParallel``, tested;
    ``DataParallel`` and accelerate's or DeepSpeed's engines follow the same pattern)."""
    peft = sys.modules.get("peft")
    if peft is not None:
        peft_model = getattr(peft, "PeftModel", None)
        if peft_model is not None and isinstance(module, peft_model):
            inner = module.get_base_model()
            if isinstance(inner, nn.Module) and inner is not module:
                base = module._modules.get("base_model")
                path = "base_model.model" if base is not None and getattr(base, "model", None) is inner else "base_model"
                return path, inner
        tuners = sys.modules.get("peft.tuners.tuners_utils")
        base_tuner = getattr(tuners, "BaseTuner", None)
        if base_tuner is not None and isinstance(module, base_tuner) and isinstance(module._modules.get("model"), nn.Module):
            return "model", module._modules["model"]
    inner = module._modules.get("module")
    if isinstance(inner, nn.Module) and not is_optimized(module):
        return "module", inner
    return None


def unwrap_model(target: nn.Module) -> tuple[nn.Module, str]:
    """The diffusers model inside the thin wrappers trainers pass (:func:`_wrapped`), and the attribute
    path to it (``""`` for a model passed as it is). A module a family handles is never unwrapped."""
    model, path = target, ""
    while not _handled(model):
        found = _wrapped(model)
        if found is None:
            break
        attr, model = found
        path = f"{path}.{attr}" if path else attr
    return model, path


def family_for(model: nn.Module, *, outer: nn.Module | None = None, path: str = "") -> Family:
    """The family of ``model``; ``outer`` and ``path``: the wrapper it was unwrapped from, for the message."""
    family = REGISTRY.for_model_type(type(model))
    if family is None:
        installed = ", ".join(f.name for f in REGISTRY.families()) or "none"
        inside = ""
        if outer is not None and path:
            inside = f" (found inside the {type(outer).__name__} passed, at .{path})"
        name = f"{type(model).__module__}.{type(model).__qualname__}"
        reason = REGISTRY.unsupported_reason(type(model))
        if reason is not None:
            raise UnsupportedModelError(
                f"gradseam does not patch {name}{inside}: {reason}. {_pass_instead(model)}Installed families: "
                f"{installed}. A plugin that declares a family for it takes precedence: see {PLUGIN_GUIDE}."
            )
        raise UnsupportedModelError(
            f"no gradseam family handles {name}{inside}. "
            f"{_pass_instead(model)}Installed families: {installed}. To support it, install or write a plugin: "
            f"see {PLUGIN_GUIDE}."
        )
    return family


def _pass_instead(model: nn.Module) -> str:
    """For a wrapper no family handles: the attribute holding a model one does, to pass instead."""
    if is_optimized(model) and isinstance(model._modules.get("_orig_mod"), nn.Module):
        inner = model._modules["_orig_mod"]
        return (f"It is torch.compile's wrapper around {type(inner).__name__} (its ._orig_mod): patch the model "
                "before compiling it (gradseam.patch(model, ...), then torch.compile(model)); the compiled "
                "wrapper of a patched model runs the patch. ")
    found = [(name, m) for name, m in model.named_modules() if name and _handled(m)]
    if not found:
        return ""
    name, inner = min(found, key=lambda nm: nm[0].count("."))
    return (f"Its submodule .{name} is a {type(inner).__name__}, which family "
            f"{REGISTRY.for_model_type(type(inner)).name!r} handles: pass that (gradseam.patch(model.{name}, ...)). ")


def _plan_unplanned(model: nn.Module, configs: dict[str, CheckpointConfig], name: str) -> Any:
    """``model``'s plan for ``configs[name]``; where "auto" would keep a model larger than its GPU budget in host
    memory and streaming refuses it (quantized weights, sharded blocks), the model runs unplanned instead, with a
    warning saying why and what that means (it must fit the GPU to reach its first step)."""
    family = family_for(model)
    try:
        return plan(model, family, configs[name])
    except UnsupportedStrategyError as exc:
        if configs[name] is not UNPLANNED_STREAMED:
            raise
        warn_once(f"gradseam: gradient_checkpointing_backend \"auto\": {type(model).__name__}'s weights are more than "
                  "the GPU budget, so its blocks' frozen weights would stay in host memory until it is planned, but "
                  f"they cannot stream ({exc}). It is planned on the GPU at its first training step as any other "
                  "model, so it must fit there first.")
        configs[name] = UNPLANNED
        return plan(model, family, UNPLANNED)


def patch_models(
    models: Mapping[str, nn.Module], config: CheckpointConfig, *, check_device: bool = True
) -> dict[str, PatchHandle]:
    """Patch several models all-or-nothing: every plan and device check passes before any is installed.

    check_device=False: load-time patching (gradseam.patching), where loaders build models on the
    CPU before the user moves them; the offload engine only moves CUDA tensors, so that is safe,
    and the handle says offload is pending until the model is on a GPU.
    """
    requested = config
    configs = {name: unplanned(model, config) if config.backend == AUTO else config  # planned at the first step
               for name, model in models.items()}
    plans = {name: _plan_unplanned(model, configs, name) for name, model in models.items()}
    for name, model in models.items():
        _check_group_offloading(model, plans[name])
        _warn_if_the_gpu_cannot_hold_what_stays(model, plans[name])
    if check_device:
        for name, model in models.items():
            _check_offload_device(model, configs[name], plans[name])
    done: dict[str, PatchHandle] = {}
    replaced: list[PatchHandle] = []
    try:
        for name, model in models.items():
            previous = handle_of(model)
            handed = None
            if previous is not None:
                if previous.weights is not None and plans[name].streamed:
                    # the new patch streams too: it takes the host copies of the blocks both stream, and only what
                    # it does not stream goes back to the device (removed first, a model larger than its GPU would
                    # have to fit there for a moment)
                    handed, previous.weights = previous.weights, None
                    handed.unhook()
                previous.remove()  # a second patch replaces the first, never stacks
                replaced.append(previous)
            handle = PatchHandle(model, plans[name])
            handle.deferred_device = not check_device
            if requested.backend == AUTO:
                handle.auto = AutoPlanning(handle, requested)
            if previous is not None:
                previous.replaced_by = handle  # its remove() says so, and which handle to remove
            try:
                handle.install(inherit=handed)
            finally:
                if handed is not None:
                    handed.remove()  # what the new stream did not take goes back to the device, its host memory freed
            done[name] = handle
    except BaseException:
        for handle in done.values():
            handle.remove()
        for previous in replaced:  # put back what the failed patch replaced
            previous.replaced_by = None
            previous.plan = plan(previous.model, previous.family, previous.config)
            previous.install()
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
        model, path = unwrap_model(target)  # PeftModel, DDP-style .module: the diffusers model inside
        if path:  # refused naming the wrapper and what to pass; a model passed as it is: patch_model refuses
            family_for(model, outer=target, path=path)
        return patch_model(model, cfg)
    supported = {n: m for n, m in components.items() if REGISTRY.for_model_type(type(m)) is not None}
    if not supported:
        installed = ", ".join(f.name for f in REGISTRY.families()) or "none"
        kinds = ", ".join(f"{n}={type(m).__name__}" for n, m in components.items())
        raise UnsupportedModelError(
            f"no component of {type(target).__name__} is handled by an installed gradseam family "
            f"(components: {kinds}; installed families: {installed}). See {PLUGIN_GUIDE}."
        )
    return PipelineHandle(target, patch_models(supported, cfg))


