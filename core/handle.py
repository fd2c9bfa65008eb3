"""A patched model's handle: what was planned and installed, how it has run, and how to undo it.

:class:`PatchHandle` owns the lifecycle: it takes over the model's own checkpointing flag, makes
the offload engine a plan needs, installs the plan (:mod:`gradseam.run.install`), notices blocks
replaced under it, and ``remove()`` restores the model exactly. ``regions()`` and ``summary()``
read the plan's specs and the installed chains' counts.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .errors import UnsupportedStrategyError, warn_once
from .kinds import staying_sibling
from .modules import device_type, resolve
from .planning import plan
from .spec import Plan
from .summary import RegionView, Summary

if TYPE_CHECKING:
    from .auto import AutoPlanning
    from .config import CheckpointConfig
    from .run.install import Installation


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

    def after(self, module: nn.Module, args: tuple, output: Any) -> None:
        """After the forward, also when it raised (so not the pre-hook's checks: they raised already)."""
        for chain in self.handle._chains:
            chain.reset()

    def __call__(self, module: nn.Module, args: tuple) -> None:
        """Before the forward."""
        handle = self.handle
        if not handle.active:
            return  # "auto" is measuring this model under other patches (gradseam.auto): they run, not this one
        for chain in handle._chains:
            chain.reset()
        if handle._blocks_replaced() or handle._changed_under_kinds():
            handle._replan()
        handle._follow()
        for engine in handle.engines.values():
            engine.refresh()
        if handle.offload_pending() and torch.is_grad_enabled():
            warn_once(
                f"gradseam: {type(handle.model).__name__} is training on the CPU with "
                f"{handle._offload_what()}; nothing is offloaded until the model is on a GPU "
                f"(model.to('cuda')). On the CPU the step runs as with {handle._runs_as_on_cpu()}; "
                "summary() says 'offload pending' until then."
            )


class PatchHandle:
    """A patched model: ``.remove()`` undoes everything, ``.summary()`` says what was done.

    ``model`` is the diffusers model patched (the one inside a wrapper ``patch`` unwrapped); ``active``
    is true until ``remove()`` or until a later ``patch()`` of the same model replaces this patch,
    which then sits in ``replaced_by`` (``remove()`` on a replaced handle warns and changes nothing).
    """

    def __init__(self, model: nn.Module, plan: Plan) -> None:
        self.model = model
        self.plan = plan
        self.family = plan.family
        self.config = plan.config
        self._flags: list[tuple[nn.Module, bool]] = []
        self._installed: Installation | None = None
        self._removed: list[Any] = []  # what the last installation held, for regions() after remove()
        self._hooks: list[Any] = []
        self._deferred: tuple[bool, tuple, dict] | None = None
        self._entries: list[tuple[str, int, nn.Module]] = []  # what sat in each block list when planned
        self._blocks: tuple[nn.Module, ...] = ()  # the same modules, for the kinds' changed_since()
        self.engines: dict[Any, Any] = {}  # an OffloadEngine per store of the plan (offload configurations)
        self.weights: Any = None  # the WeightStream of the plan's streamed blocks (gradseam.offload.weights), or None
        self.deferred_device = False  # load-time patching: offload starts once the model is on a GPU
        self.active = False
        self._aside = False  # inside set_aside(): a patch made meanwhile borrows this one's streamed host copies
        self.replaced_by: PatchHandle | None = None  # the later patch() of the same model that replaced this one
        self.auto: AutoPlanning | None = None  # with gradient_checkpointing_backend "auto": its planning hook

    @property
    def engine(self) -> Any:
        """The offload engine (host memory), or None when the plan moves nothing."""
        return next(iter(self.engines.values()), None)

    def install(self, inherit: Any = None) -> None:
        """Take over the model's checkpointing and install the plan (the patcher calls this once). ``inherit``: the
        stream of the patch this one replaces, whose host copies the new stream takes over where it can."""
        model = self.model
        # Own checkpointing: the model's built-in flag would nest a second checkpoint around ours.
        for module in model.modules():
            if getattr(module, "gradient_checkpointing", False) is True:
                self._flags.append((module, True))
                module.gradient_checkpointing = False
        self._guard_enable()
        self._make_engines()
        self._install_regions()
        self._stream_weights(inherit)
        hooks = _ModelHooks(self)
        self._hooks = [model.register_forward_pre_hook(hooks), model.register_forward_hook(hooks.after, always_call=True)]
        if self.auto is not None:  # first among the pre-hooks: the handle's own then sees the planned regions
            self._hooks.append(model.register_forward_pre_hook(self.auto, with_kwargs=True, prepend=True))
        self.active = True

    def _guard_enable(self) -> None:
        for name, enable in (("enable_gradient_checkpointing", True), ("disable_gradient_checkpointing", False)):
            if hasattr(self.model, name):
                setattr(self.model, name, _GuardedEnable(self, enable))

    def _make_engines(self) -> None:
        if self.plan.stores:
            from .offload import engine_for  # only offload configs pay for it

            for store in self.plan.stores:
                engine = self.engines[store.destination] = engine_for(store.destination.value, store.max_buckets)
                engine.watch(self.model)

    def adopt(self, config: CheckpointConfig) -> None:
        """Run ``config`` from now on (``"auto"``'s plan, :mod:`gradseam.auto`): planned first, so a refused
        config raises before anything changes, then installed as ``patch()`` would, in this handle."""
        new_plan = plan(self.model, self.family, config)
        # The same blocks streamed before and after (a model too large for its GPU, which "auto" streamed whole
        # until it was planned): their weights stay in host memory. Put back first, they would have to fit the GPU.
        kept = self.weights if self.weights is not None and new_plan.streamed == self.plan.streamed \
            and new_plan.config.gradient_checkpointing_stream_prefetch == self.weights.prefetch else None
        # Other blocks streamed (the plan keeps some of them resident): the new stream takes over the host copies of
        # the blocks both stream, and only then are the others put back on the GPU, so no block's weights are ever on
        # the GPU unless the plan keeps them there, and none is copied to host memory twice.
        handed = self.weights if self.weights is not None and kept is None else None
        if kept is not None:
            kept.unhook()
        elif handed is not None:
            handed.unhook()
            self.weights = None
        self._uninstall_regions()
        for engine in self.engines.values():
            engine.close()
        self.engines = {}
        self.config, self.plan = config, new_plan
        self._guard_enable()  # a patch made while planning (to measure) took the model's methods back on removal
        self._make_engines()
        self._install_regions()
        if kept is not None:
            kept.install(self.model)  # hooked after the regions, as a fresh stream would be
        else:
            self._stream_weights(inherit=handed)
            if handed is not None:
                handed.remove()  # what the new stream did not take over goes back where the model keeps it

    @contextmanager
    def set_aside(self) -> Iterator[None]:
        """Nothing of this patch acts on the model inside (``"auto"`` measures it under patches of its own): the
        regions are uninstalled and streamed weights stay in host memory unhooked; all put back on exit (the
        weights in host memory, wherever a measuring patch left them)."""
        stream = self.weights
        if stream is not None:
            stream.unhook()
        self._uninstall_regions()
        self._aside = True
        try:
            yield
        finally:
            self._aside = False
            self._install_regions()
            if stream is not None:
                stream.park()
                stream.install(self.model)

    def _install_regions(self) -> None:
        from .run.install import Installation

        self._installed = Installation(self.plan, self.model, self.engines)
        self._entries = [
            (bl.path, i, m) for bl in self.family.block_lists
            if isinstance(lst := resolve(self.model, bl.path), nn.ModuleList) for i, m in enumerate(lst)
        ]
        self._blocks = tuple(m for _, _, m in self._entries)

    def _stream_weights(self, inherit: Any = None) -> None:
        """Hand the plan's streamed blocks to a WeightStream, which keeps their frozen weights in host memory
        (taken over from ``inherit``, the replaced patch's stream, where it streamed the same block)."""
        if not self.plan.streamed:
            return
        from .offload import cpu_allowed
        from .offload.weights import WeightStream

        name = type(self.model).__name__
        lists = {bl.path: bl for bl in self.family.block_lists}
        blocks = [resolve(self.model, path)[index] for path, index in self.plan.streamed]
        labels = [f"{name}.{path}[{index}]" for path, index in self.plan.streamed]
        # what the model calls outside a block (DiT's final modulation, block 0's norm1.emb) stays resident
        keep = [lists[path].outside(index, len(resolve(self.model, path))) for path, index in self.plan.streamed]
        # a patch made while another is set aside ("auto" measuring) runs from that one's host copies
        lender = None if inherit is not None else _set_aside_stream(self.model, self)
        self.weights = WeightStream(blocks, labels, error=UnsupportedStrategyError, test_mode=cpu_allowed(),
                                    prefetch=self.plan.config.gradient_checkpointing_stream_prefetch, keep=keep,
                                    inherit=inherit, lender=lender)
        self.weights.install(self.model)

    def _unstream_weights(self) -> None:
        if self.weights is not None:
            self.weights.remove()
            self.weights = None

    def _uninstall_regions(self) -> None:
        if self._installed is not None:
            self._removed = self._installed.regions  # their counts stay readable after remove()
            self._installed.remove()
            self._installed = None

    @property
    def _chains(self) -> list[Any]:
        return self._installed.chains if self._installed is not None else []

    def _blocks_replaced(self) -> bool:
        """Whether something replaced a block since planning (torch's ``apply_activation_checkpointing``
        wraps blocks in a ``CheckpointWrapper`` by setting them on their list): one identity check per block."""
        lists: dict[str, Any] = {}
        for path, index, module in self._entries:
            lst = lists[path] if path in lists else lists.setdefault(path, resolve(self.model, path))
            if lst is None or index >= len(lst) or lst[index] is not module:
                return True
        return False

    def _changed_under_kinds(self) -> bool:
        """Whether a kind of the plan sees the model changed under it since patching (the user compiled a
        block under a compiled backend, say): planning again then refuses it by name."""
        return any(kind.changed_since(self.model, self._blocks) for kind in self.plan.kinds)

    def _replan(self) -> None:
        """Plan again around replaced blocks and reinstall; a block now inside torch's checkpoint wrapper
        is left to it (planning warns once), exactly as when the wrapper came before gradseam."""
        new_plan = plan(self.model, self.family, self.config)
        self._unstream_weights()
        self._uninstall_regions()
        self.plan = new_plan
        self._install_regions()
        self._stream_weights()

    def offload_pending(self) -> bool:
        """True while an offload configuration cannot offload yet: the model is still on the CPU.

        Asked of the engines, not of the test switch at call time: an engine made in the CPU test mode
        offloads a CPU model wherever it runs, and one made outside it never does."""
        return device_type(self.model) == "cpu" and any(not engine.test_mode for engine in self.engines.values())

    def _offload_what(self) -> str:
        return " and ".join(self.plan.offloaded())

    def _runs_as_on_cpu(self) -> str:
        backend = self.plan.strategy.backend
        if backend is None:
            return "no checkpointing and nothing offloaded"
        return f"the {staying_sibling(backend).name!r} backend" + (" and no attention offload"
                                                          if self.plan.strategy.attention_offload else "")

    def regions(self) -> tuple[RegionView, ...]:
        """What this handle installed, region by region, with how each has run so far (read-only;
        the counts stay readable after ``remove()``)."""
        installed = self._installed.regions if self._installed is not None else self._removed
        return tuple(RegionView.of(done.spec, done.stats) for done in installed)

    def _follow(self) -> None:
        if self._installed is not None:
            self._installed.follow()

    def remove(self) -> None:
        """Restore the model exactly as it was (idempotent). On a handle that a later ``patch()`` of the
        same model replaced, it changes nothing (the later patch is the model's) and warns, naming the
        handle to remove instead."""
        if not self.active:
            if self.replaced_by is not None:
                warn_once(
                    f"gradseam: remove() on a replaced handle does nothing: this patch of {type(self.model).__name__} "
                    f"({self.config.describe()}) was replaced by a later gradseam.patch() of the same model, "
                    f"{self.replaced_by!r}. To restore the model, remove that handle "
                    "(gradseam.handle_of(model).remove())."
                )
            return
        self._unstream_weights()
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
        for engine in self.engines.values():
            engine.close()  # the pinned host memory goes now, not whenever the handle is collected
        self.active = False

    def __enter__(self) -> PatchHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def summary(self) -> Summary:
        summary = Summary.of(self.plan, self.regions(), pending=self.offload_pending(),
                             model_name=type(self.model).__name__, device=device_type(self.model))
        if self.weights is not None and not self.weights.selected:
            summary.notes.append(
                f"weights of {len(self.weights.blocks)} block(s) will stream from host memory once the base is "
                "frozen: at the model's first move to a GPU or its first forward")
        elif self.weights is not None:
            w = self.weights
            activations = sum(engine.store.stats()["pinned_bytes"] for engine in self.engines.values())
            ahead = f"{w.prefetch} block{'' if w.prefetch == 1 else 's'} ahead on a side stream" if w.ahead else \
                "each copy waited for (prefetch 0)" if not w.naive else \
                "each copied in and back out on the compute stream (the naive reference)"
            summary.notes.append(
                f"weights of {len(w.blocks)} block(s) stream from host memory ({_blocks_named(self.plan.streamed)}): "
                f"{w.host_bytes / 2**30:.2f} GiB "
                f"({'pinned' if w.pinned_bytes == w.host_bytes else 'pageable' if not w.pinned_bytes else 'partly pinned'})"
                f", copied to the GPU {ahead}; {w.loads} block loads so far. Pinned host memory now: weights "
                f"{w.pinned_bytes / 2**30:.2f} GiB, offloaded activations {activations / 2**30:.2f} GiB")
            kept = [f"{block.label}.{path}" for block, paths in zip(w.blocks, w.keep) for path in paths]
            if kept:
                summary.notes.append(f"kept with the model, not streamed (the model calls them outside their block): "
                                     f"{', '.join(kept)}")
        if self.auto is not None:
            summary.notes.insert(0, self.auto.describe())
        if not self.active and self.replaced_by is not None:
            summary.notes.append(f"replaced by a later gradseam.patch() of this model ({self.replaced_by!r}): "
                                 "this patch no longer runs; the model's summary is that handle's")
        return summary

    def __repr__(self) -> str:
        state = "active" if self.active else "replaced by a later patch" if self.replaced_by is not None else "removed"
        what = self.config.describe() if self.auto is None or self.auto.planned is not None else "auto, not planned yet"
        return f"<gradseam patch {self.family.name} [{what}{', planned by auto' if self.auto is not None and self.auto.planned else ''}] {state}>"


class PipelineHandle:
    """Handles for every patched component of a pipeline."""

    def __init__(self, pipeline: Any, handles: Mapping[str, PatchHandle]) -> None:
        self.pipeline = pipeline
        self.handles = dict(handles)

    def remove(self) -> None:
        for handle in self.handles.values():
            handle.remove()

    def summary(self) -> Summary:
        return Summary.merge({name: h.summary() for name, h in self.handles.items()})

    def __getitem__(self, name: str) -> PatchHandle:
        return self.handles[name]

    def __enter__(self) -> PipelineHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


@contextmanager
def lending(model: nn.Module) -> Iterator[None]:
    """Inside, the blocks of ``model`` (as cut now) whose weights a set-aside patch keeps in host memory, and that no
    measuring patch streams, are on the GPU: how ``"auto"`` measures a candidate that keeps some blocks resident on a
    model larger than its GPU (:meth:`gradseam.offload.weights.WeightStream.lent`). Nothing happens for a model
    without such a patch."""
    stream = _set_aside_stream(model, None)
    if stream is None:
        yield
        return
    measuring = {id(block.module) for hook in model._forward_pre_hooks.values()
                 if isinstance(hook, _ModelHooks) and not hook.handle._aside and hook.handle.weights is not None
                 for block in hook.handle.weights.blocks}
    with stream.lent({id(m) for m in model.modules()} - measuring):
        yield


def _set_aside_stream(model: nn.Module, asking: PatchHandle | None) -> Any:
    """The weight stream of a patch of ``model`` set aside (:meth:`PatchHandle.set_aside`) by another than
    ``asking``, or None."""
    for hook in getattr(model, "_forward_pre_hooks", {}).values():
        if isinstance(hook, _ModelHooks) and hook.handle is not asking and hook.handle._aside \
                and hook.handle.weights is not None:
            return hook.handle.weights
    return None


def handle_of(model: nn.Module) -> PatchHandle | None:
    """The active gradseam handle of a model, if it is patched."""
    for hook in getattr(model, "_forward_pre_hooks", {}).values():
        if isinstance(hook, _ModelHooks) and hook.handle.active and hook.handle.model is model:
            return hook.handle
    return None


def _blocks_named(streamed: tuple[tuple[str, int], ...]) -> str:
    """``transformer_blocks 2, 6; single_transformer_blocks 1, 5``: the streamed blocks, by list, in order."""
    lists: dict[str, list[int]] = {}
    for path, index in streamed:
        lists.setdefault(path, []).append(index)
    return "; ".join(f"{path} {', '.join(map(str, indices))}" for path, indices in lists.items())
