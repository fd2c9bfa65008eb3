"""``gradseam.patch``: resolve a model's family, plan its regions, install them, and undo it all.

The plan (:mod:`gradseam.planning`) is computed first and only then installed, so a refused
configuration raises before the model is touched.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from . import seams
from .config import CheckpointConfig
from .errors import PLUGIN_GUIDE, UnsupportedModelError, UnsupportedStrategyError
from .family import Family
from .links import BlockLink, SeamLink
from .planning import (  # noqa: F401 - GradseamWarning and warned are re-exported for callers of this module
    GradseamWarning,
    Plan,
    Region,
    plan,
    resolve,
    unwrap,
    warn_once,
    warned,
)
from .registry import REGISTRY
from .strategies import Chain

if TYPE_CHECKING:
    from .kernels import KernelSet
    from .summary import Summary


@dataclass(frozen=True)
class RegionView:
    """One region a handle installed, as tools and tests may read it (``handle.regions()``).

    ``calls`` counts, per member module, the calls made with gradients enabled; ``runs`` the
    checkpoint regions computed (a whole chunk counts once); ``chunk_calls`` the calls that ran a
    whole chunk and ``served`` the later members answered from it; ``fallbacks`` maps each reason
    a member had to compute on its own to how often it happened. Attention-offload regions are no
    checkpoint regions: their counts stay empty.
    """

    list_path: str
    blocks: tuple[int, ...]
    kind: str  # "block", "chunk", "ffn" or "attention-offload"
    block_class: str
    seam: tuple[str, ...]
    calls: tuple[int, ...] = ()
    runs: int = 0
    chunk_calls: int = 0
    served: int = 0
    fallbacks: Mapping[str, int] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return f"{self.list_path}{list(self.blocks)}" + (f".{'→'.join(self.seam)}" if self.seam else "")

    @property
    def ran(self) -> bool:
        return bool(self.calls) and self.calls[0] > 0

    @property
    def whole(self) -> bool:
        """Every call of the region computed it as one region (a chunk's later members were served)."""
        first = self.calls[0] if self.calls else 0
        return not self.fallbacks and self.runs == first and all(c == first for c in self.calls)


# -- installing and removing ------------------------------------------------------------------


def _model_device(model: nn.Module) -> str:
    for p in model.parameters():
        return p.device.type
    return "cpu"


def _check_offload_device(model: nn.Module, config: CheckpointConfig) -> None:
    from .offload import cpu_allowed

    wants = [f"backend {config.backend!r}"] if config.enabled and config.offloads_regions else []
    if config.offload_attention:
        wants.append("gradient_checkpointing_offload_attention")
    device = _model_device(model)
    if wants and device == "cpu" and not cpu_allowed():
        raise UnsupportedStrategyError(
            f"{' and '.join(wants)} {'moves' if len(wants) == 1 else 'move'} activations from GPU to CPU "
            f"memory and {'needs' if len(wants) == 1 else 'need'} a CUDA model, but "
            f"{type(model).__name__} is on the CPU. Move the model to a GPU first (model.to('cuda')), "
            "or use backend 'torch' / 'torch-ffn' on the CPU."
        )


class _GuardedEnable:
    """Stands in for ``model.enable_gradient_checkpointing`` while gradseam owns checkpointing.

    Calling the built-in flag on top of gradseam would checkpoint twice (and, on Chroma's single
    blocks, drop the attention mask), so the call is recorded and replayed only on ``remove()``.
    """

    def __init__(self, handle: PatchHandle, enable: bool) -> None:
        self.handle = handle
        self.enable = enable

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        what = "enable" if self.enable else "disable"
        warn_once(
            f"{what}_gradient_checkpointing() called on a model patched by gradseam; gradseam owns "
            "checkpointing while the patch is active, so the call is deferred until handle.remove()."
        )
        self.handle._deferred = (self.enable, args, kwargs)


class _ModelHooks:
    """A forward pre-hook and always-called forward hook on the patched model itself.

    It ties the model to its handle: :func:`handle_of` finds it among the model's hooks. Living
    in the model, it goes wherever the model goes: ``copy.deepcopy`` and pickling give a patched
    copy its own handle (re-patching the copy replaces, never stacks), and nothing global keeps
    a patched model alive. Around every forward it also resets each chain, dropping what a chain
    holds between its head and its later members: when a forward stops in between (an exception
    in a hook, or in the model's code between two blocks), those outputs, and through their
    graph the step's activations, would otherwise stay referenced until the chain next runs.
    An exception resets at once; a ``KeyboardInterrupt`` (torch runs always-called hooks for
    ``Exception`` only) at the start of the next forward.
    """

    def __init__(self, handle: PatchHandle) -> None:
        self.handle = handle

    def __call__(self, module: nn.Module, args: tuple, output: Any = None) -> None:
        handle = self.handle
        for chain in handle._chains:
            chain.reset()
        if output is None:  # before the forward
            if handle._blocks_replaced():
                handle._replan()
            handle._follow()
            if handle.engine is not None:
                handle.engine.refresh()
                if handle.offload_pending() and torch.is_grad_enabled():
                    warn_once(
                        f"gradseam: {type(handle.model).__name__} is training on the CPU with "
                        f"{handle._offload_what()}; nothing is offloaded until the model is on a GPU "
                        "(model.to('cuda')). On the CPU the step runs as with the 'torch' / 'torch-ffn' "
                        "backend; summary() says 'offload pending' until then."
                    )


class _Slot:
    """Where a seam on a block's submodule sits, so that a replaced submodule can be followed.

    PEFT (``add_adapter``, ``get_peft_model``) replaces each targeted ``nn.Linear`` with a LoRA
    layer that calls the original as its ``base_layer``. A seam on the Linear itself (Flux's
    single-block FFN seam starts at ``proj_mlp``) would then see only the base output, the chain
    would fall back to per-member regions and stop saving memory. Before each forward the handle
    checks each slot and moves the seam to whatever module now sits there (and back on unload).
    """

    __slots__ = ("chain", "index", "name", "parent", "seam", "where")

    def __init__(self, parent: nn.Module, name: str, seam: seams.SeamForward, chain: Chain | None, index: int,
                 where: str) -> None:
        self.parent, self.name, self.seam, self.chain, self.index, self.where = parent, name, seam, chain, index, where


class PatchHandle:
    """A patched model: ``.remove()`` undoes everything, ``.summary()`` says what was done."""

    def __init__(self, model: nn.Module, plan: Plan) -> None:
        self.model = model
        self.plan = plan
        self.family = plan.family
        self.config = plan.config
        self._seams: list[seams.SeamForward] = []
        self._flags: list[tuple[nn.Module, bool]] = []
        self._chains: list[Chain] = []
        self._slots: list[_Slot] = []
        self._hooks: list[Any] = []
        self._deferred: tuple[bool, tuple, dict] | None = None
        self._entries: list[tuple[str, int, nn.Module]] = []  # what sat in each block list when planned
        self.engine: Any = None  # the OffloadEngine, for offload configurations
        self.deferred_device = False  # load-time patching: offload starts once the model is on a GPU
        self.active = False

    def _install(self) -> None:
        model, config = self.model, self.config
        # Own checkpointing: the model's built-in flag would nest a second checkpoint around ours.
        for module in model.modules():
            if getattr(module, "gradient_checkpointing", False) is True:
                self._flags.append((module, True))
                module.gradient_checkpointing = False
        for name, enable in (("enable_gradient_checkpointing", True), ("disable_gradient_checkpointing", False)):
            if hasattr(model, name):
                setattr(model, name, _GuardedEnable(self, enable))
        if config.needs_engine:
            from .offload import engine_for  # only offload configs pay for it

            self.engine = engine_for(config.pin_buckets)
            self.engine.watch(model)
        self._install_regions()
        hooks = _ModelHooks(self)
        self._hooks = [model.register_forward_pre_hook(hooks), model.register_forward_hook(hooks, always_call=True)]
        self.active = True

    def _install_regions(self) -> None:
        config, family = self.config, self.family
        kernels = attention_kernels() if config.kept_kernels else None
        runner = config.backend_spec.runner(self.engine, kernels, offload_kernels=config.kept_kernels == "cpu")
        attention_offload = None
        if self.engine is not None:
            from .scopes import AttentionOffload

            attention_offload = AttentionOffload(self.engine)
        for region in self.plan.regions:
            if region.kind == "attention-offload":
                self._seams.append(seams.install(region.modules[0], attention_offload, owner=self.model))
                self._watch(region, 0, self._seams[-1], None)
                continue
            if region.kind == "chunk":
                block_list = next(bl for bl in family.block_lists if bl.path == region.list_path)
                assert block_list.carry is not None
                where = f"family {family.name!r}, block list {region.list_path!r}"
                link: Any = BlockLink(block_list.carry, where=where, per_block=block_list.per_block)
            else:
                link = SeamLink() if len(region.modules) > 1 else None
            chain = Chain(region.modules, link, runner, label=f"{region.list_path}{list(region.blocks)}")
            region.stats = chain.stats
            for index, module in enumerate(region.modules):
                seam = seams.install(module, chain.handler(index), owner=self.model)
                chain.attach(index, seam.original)
                self._seams.append(seam)
                if region.kind == "ffn":
                    self._watch(region, index, seam, chain)
            self._chains.append(chain)
        self._entries = [
            (bl.path, i, m) for bl in family.block_lists
            if isinstance(lst := resolve(self.model, bl.path), nn.ModuleList) for i, m in enumerate(lst)
        ]

    def _uninstall_regions(self) -> None:
        for seam in reversed(self._seams):
            seams.uninstall(seam)
        self._seams.clear()
        self._chains.clear()
        self._slots.clear()

    def _blocks_replaced(self) -> bool:
        """Whether something replaced a block since planning (torch's ``apply_activation_checkpointing``
        wraps blocks in a ``CheckpointWrapper`` by setting them on their list): one identity check per block."""
        lists: dict[str, Any] = {}
        for path, index, module in self._entries:
            lst = lists[path] if path in lists else lists.setdefault(path, resolve(self.model, path))
            if lst is None or index >= len(lst) or lst[index] is not module:
                return True
        return False

    def _replan(self) -> None:
        """Plan again around replaced blocks and reinstall; a block now inside torch's checkpoint wrapper
        is left to it (planning warns once), exactly as when the wrapper came before gradseam."""
        new_plan = plan(self.model, self.family, self.config)
        self._uninstall_regions()
        self.plan = new_plan
        self._install_regions()

    def offload_pending(self) -> bool:
        """True while an offload configuration cannot offload yet: the model is still on the CPU."""
        from .offload import cpu_allowed

        return self.engine is not None and _model_device(self.model) == "cpu" and not cpu_allowed()

    def _offload_what(self) -> str:
        config = self.config
        wants = [f"backend {config.backend!r}"] if config.enabled and config.offloads_regions else []
        if config.offload_attention:
            wants.append("gradient_checkpointing_offload_attention")
        return " and ".join(wants)

    def regions(self) -> tuple[RegionView, ...]:
        """What this handle installed, region by region, with how each has run so far (read-only;
        the counts stay readable after ``remove()``)."""
        out = []
        for r in self.plan.regions:
            s = r.stats
            out.append(RegionView(
                r.list_path, r.blocks, r.kind, r.block_class, r.seam,
                calls=tuple(s.member_calls) if s else (), runs=s.runs if s else 0,
                chunk_calls=s.chunk_calls if s else 0, served=s.served if s else 0,
                fallbacks=dict(s.fallbacks) if s else {},
            ))
        return tuple(out)

    def _watch(self, region: Region, index: int, seam: seams.SeamForward, chain: Chain | None) -> None:
        block = unwrap(resolve(self.model, region.list_path)[region.blocks[0]])
        parent_path, _, name = region.seam[index].rpartition(".")
        parent = resolve(block, parent_path) if parent_path else block
        where = f"{region.list_path}[{region.blocks[0]}].{region.seam[index]}"
        self._slots.append(_Slot(parent, name, seam, chain, index, where))

    def _follow(self) -> None:
        """Move each submodule seam to the module now at its place, if something replaced it."""
        for slot in self._slots:
            old = slot.seam
            current = slot.parent._modules.get(slot.name)
            if current is old.module:
                continue
            if current is None:
                raise UnsupportedModelError(
                    f"{type(self.model).__name__}.{slot.where} was removed after gradseam patched it; "
                    "patch the model again (gradseam.patch replaces the old patch)."
                )
            handler = old.handler
            seams.uninstall(old)
            new = seams.install(current, handler, owner=self.model)  # type: ignore[arg-type]
            if slot.chain is not None:
                slot.chain.members[slot.index] = current
                slot.chain.attach(slot.index, new.original)
            for region in self.plan.regions:
                if any(m is old.module for m in region.modules):
                    region.modules = tuple(current if m is old.module else m for m in region.modules)
            self._seams[next(i for i, s in enumerate(self._seams) if s is old)] = new
            slot.seam = new

    def remove(self) -> None:
        """Restore the model exactly as it was (idempotent)."""
        if not self.active:
            return
        self._uninstall_regions()
        for name in ("enable_gradient_checkpointing", "disable_gradient_checkpointing"):
            if isinstance(self.model.__dict__.get(name), _GuardedEnable):
                delattr(self.model, name)
        for module, value in self._flags:
            module.gradient_checkpointing = value
        self._flags.clear()
        if self._deferred is not None:
            enable, args, kwargs = self._deferred
            getattr(self.model, "enable_gradient_checkpointing" if enable else "disable_gradient_checkpointing")(
                *args, **kwargs
            )
            self._deferred = None
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        self.active = False

    def __enter__(self) -> PatchHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def summary(self) -> Summary:
        from .summary import Summary

        return Summary.of(self)

    def __repr__(self) -> str:
        state = "active" if self.active else "removed"
        return f"<gradseam patch {self.family.name} [{self.config.describe()}] {state}>"


class PipelineHandle:
    """Handles for every patched component of a pipeline."""

    def __init__(self, pipeline: Any, handles: Mapping[str, PatchHandle]) -> None:
        self.pipeline = pipeline
        self.handles = dict(handles)

    def remove(self) -> None:
        for handle in self.handles.values():
            handle.remove()

    def summary(self) -> Summary:
        from .summary import Summary

        return Summary.merge({name: h.summary() for name, h in self.handles.items()})

    def __getitem__(self, name: str) -> PatchHandle:
        return self.handles[name]

    def __enter__(self) -> PipelineHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


_kernel_sets: dict[frozenset[str], KernelSet] = {}


def attention_kernels() -> KernelSet:
    """The attention kernels installed plugins name, as one memoised matcher per set of names."""
    from .kernels import KernelSet

    names = REGISTRY.attention_kernels()
    found = _kernel_sets.get(names)
    if found is None:
        found = _kernel_sets[names] = KernelSet(names)
    return found


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
        for model in models.values():
            _check_offload_device(model, config)
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
    if not cfg.enabled:
        set_keys = [k for k in ("gradient_checkpointing_interval", "gradient_checkpointing_segment_stride")
                    if getattr(cfg, k) is not None]
        if cfg.backend != "torch":
            set_keys.insert(0, "gradient_checkpointing_backend")
        if set_keys:
            warn_once(
                f"{', '.join(set_keys)} set but gradient_checkpointing is false: no checkpointing will run. "
                "Set gradient_checkpointing to true to use them."
            )
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


def handle_of(model: nn.Module) -> PatchHandle | None:
    """The active gradseam handle of a model, if it is patched."""
    for hook in getattr(model, "_forward_pre_hooks", {}).values():
        if isinstance(hook, _ModelHooks) and hook.handle.active and hook.handle.model is model:
            return hook.handle
    return None
