"""Load-time patching: every diffusers model loaded inside ``with gradseam.patching(config):`` comes out patched.

::

    with gradseam.patching(gradient_checkpointing=True, gradient_checkpointing_backend="torch-ffn"):
        pipe = FluxPipeline.from_pretrained("black-forest-labs/FLUX.1-dev", dtype=torch.bfloat16)
    gradseam.handles(pipe)  # the handles of the patched components (here: the transformer)

While a block is open, diffusers' loaders are wrapped on their defining classes, so every subclass
is covered: ``ModelMixin.from_pretrained`` (and ``LegacyModelMixin``'s override),
``FromOriginalModelMixin.from_single_file``, ``DiffusionPipeline.from_pretrained`` and
``FromSingleFileMixin.from_single_file``. When the outermost loader call returns, the model it
built is patched if an installed family handles its class; a pipeline gets every component patched
whose class a family handles, except components the caller passed in (``transformer=my_model``),
which are the caller's to patch. Anything no family handles (VAE, text encoders, schedulers) is left
alone, silently: that is expected in a pipeline. A model a family handles but cannot patch with the
config (an ``-ffn`` backend on a family without an FFN boundary, say) raises, as ``patch`` would.

Loaders build models on the CPU, so the offload backends skip ``patch``'s "needs a CUDA model"
check here: the engine moves only CUDA tensors, and offloads once the model is moved to the GPU.

``on_patch=callback`` is called as ``callback(handle, component)`` right after each model is
patched (``component`` is the pipeline attribute name, or None for a model loaded on its own), so
a caller that does not hold the loaded object (``gradseam run``, which runs someone else's script)
can report what was patched, and when.

Leaving the outermost block restores every loader attribute to the exact object it was (also when
the block raises). Blocks nest; the innermost config applies. Models keep their patches after the
block; ``handle.remove()`` or ``gradseam.handles(pipe).remove()`` undoes them.

Threads: the loader attributes are process-wide, so they stay wrapped while any thread is inside a
block, but the config stack is per thread: only loads on a thread that is inside a block are
patched, and a load another thread runs meanwhile (or a worker thread the block starts) is not.
If some other library replaces a loader attribute while a block is open, leaving the block cannot
unlink gradseam's wrapper from under it; the wrapper stays and does nothing outside a block.
"""

from __future__ import annotations

import functools
import importlib
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from torch import nn

from .config import CheckpointConfig
from .handle import PatchHandle, PipelineHandle, handle_of
from .patcher import (
    patch_model,
    patch_models,
    pipeline_components,
    unwrap_model,
)
from .registry import REGISTRY

# (module, class, classmethod) of every loader that builds a model or a pipeline
LOADERS: tuple[tuple[str, str, str], ...] = (
    ("diffusers.models.modeling_utils", "ModelMixin", "from_pretrained"),
    ("diffusers.models.modeling_utils", "LegacyModelMixin", "from_pretrained"),
    ("diffusers.loaders.single_file_model", "FromOriginalModelMixin", "from_single_file"),
    ("diffusers.pipelines.pipeline_utils", "DiffusionPipeline", "from_pretrained"),
    ("diffusers.loaders.single_file", "FromSingleFileMixin", "from_single_file"),
)


class _ThreadState(threading.local):
    def __init__(self) -> None:
        self.sessions: list[_Session] = []  # the open blocks of this thread, innermost last
        self.depth = 0  # loader calls in progress on this thread (a pipeline load nests model loads)


OnPatch = Callable[[PatchHandle, str | None], None]


class _Session:
    def __init__(self, config: CheckpointConfig, on_patch: OnPatch | None = None) -> None:
        self.config = config
        self.handles: list[PatchHandle] = []
        self.on_patch = on_patch

    def add(self, handle: PatchHandle, component: str | None) -> None:
        self.handles.append(handle)
        if self.on_patch is not None:
            self.on_patch(handle, component)


_local = _ThreadState()
_lock = threading.Lock()
_users = 0  # open blocks, all threads together
_installed: list[tuple[type, str, Any, Any]] = []  # (owner, name, original descriptor, our descriptor)


def _wrap(original: classmethod) -> classmethod:
    func = original.__func__

    @functools.wraps(func)
    def load(cls: type, *args: Any, **kwargs: Any) -> Any:
        state = _local
        if not state.sessions:  # no block open on this thread
            return original.__get__(None, cls)(*args, **kwargs)
        passed = {id(v) for v in kwargs.values() if isinstance(v, nn.Module)}
        state.depth += 1
        try:
            result = original.__get__(None, cls)(*args, **kwargs)
        finally:
            state.depth -= 1
        if state.depth == 0 and state.sessions:  # the outermost loader: patch what it built
            _patch_loaded(result, state.sessions[-1], passed)
        return result

    return classmethod(load)


def _handled(module: Any) -> bool:
    return isinstance(module, nn.Module) and REGISTRY.for_model_type(type(module)) is not None


def _patch_loaded(result: Any, session: _Session, passed: set[int]) -> None:
    if isinstance(result, nn.Module):
        if _handled(result) and handle_of(result) is None:
            session.add(patch_model(result, session.config, check_device=False), None)
        return
    components = pipeline_components(result)
    if components is None:
        return
    todo = {
        name: m for name, m in components.items()
        if id(m) not in passed and _handled(m) and handle_of(m) is None
    }
    for name, handle in patch_models(todo, session.config, check_device=False).items():
        session.add(handle, name)


def _install() -> None:
    for module_name, class_name, attr in LOADERS:
        try:
            owner = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError):  # an older or trimmed diffusers: nothing to wrap there
            continue
        original = owner.__dict__.get(attr)
        if not isinstance(original, classmethod):
            continue
        ours = _wrap(original)
        setattr(owner, attr, ours)
        _installed.append((owner, attr, original, ours))


def _restore() -> None:
    for owner, attr, original, ours in reversed(_installed):
        if owner.__dict__.get(attr) is ours:
            setattr(owner, attr, original)
        # else: someone wrapped it after us; ours stays in their chain and passes through outside a block
    _installed.clear()


@contextmanager
def patching(
    config: CheckpointConfig | Mapping[str, Any] | None = None, *, on_patch: OnPatch | None = None, **kwargs: Any
) -> Iterator[list[PatchHandle]]:
    """Patch every diffusers model loaded inside the block; yields the list of handles made so far."""
    global _users
    cfg = CheckpointConfig.coerce(config, **kwargs)  # a bad config raises before anything is wrapped
    cfg.warn_if_idle("gradseam.patching")
    session = _Session(cfg, on_patch)
    with _lock:
        if _users == 0:
            _install()
        _users += 1
    _local.sessions.append(session)
    try:
        yield session.handles
    finally:
        _local.sessions.remove(session)
        with _lock:
            _users -= 1
            if _users == 0:
                _restore()


def handles(target: Any) -> PatchHandle | PipelineHandle | None:
    """The handle of a patched model, or a :class:`PipelineHandle` over a pipeline's patched components.

    None when nothing is patched. For a pipeline the handle covers the components patched now,
    however they were patched (at load time, by ``gradseam.patch``, or passed in patched).
    """
    if isinstance(target, nn.Module):
        return handle_of(unwrap_model(target)[0])  # a PeftModel or DDP wrapper: the model inside
    components = pipeline_components(target)
    if components is None:
        raise TypeError(f"gradseam.handles expects a diffusers model or pipeline, got {type(target).__name__}.")
    found = {name: h for name, m in components.items() if (h := handle_of(m)) is not None}
    return PipelineHandle(target, found) if found else None
