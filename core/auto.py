"""``gradient_checkpointing_backend: "auto"``: each block's strategy chosen at the first training step.

Why at the first training step, not at patch time: the plan depends on what the step costs, and that
depends on the shapes of the batch (resolution, frames, sequence length) and on where the model runs,
neither of which ``patch()`` knows (load-time patching builds the model on the CPU before it moves). So a
model patched with ``"auto"`` runs unpatched until its first forward with gradients enabled and a
trainable parameter (an evaluation or inference forward before it needs no checkpointing). That forward's
pre-hook asks the planner for an explicit config (top-level keys and ``gradient_checkpointing_blocks``),
installs it through the handle, and lets the forward run: from then on the model runs exactly as if that
explicit config had been given to ``patch()``, which is how the plan is reproduced or saved
(``handle.auto.config``, printed in ``summary()``).

One exception to "runs unpatched": a model still on the CPU at patch time whose weights are more than the GPU
budget could never reach its first training step, since moving it to the GPU would run out of memory first. It
keeps every block's frozen weights in host memory from patch time (:func:`unplanned`), so the move leaves them
behind; the planner then plans which blocks keep their weights resident and which stream, and the handle hands
the plan's stream the host copies of the blocks it streams before the others come back to the GPU (moved back
first, they would not fit). A model that fits the GPU but leaves no room beside its weights to measure anything
(HunyuanVideo 1.5 at 480p x 121 frames under 24 GiB: 15.6 GiB of weights, and every candidate ran out of memory
at two blocks) gets the same treatment at its first step, once the planner says so (:class:`NoRoomBesideWeights`):
its blocks' frozen weights go to host memory and it is planned as a model larger than its GPU. While measuring,
that stream steps aside
(:meth:`gradseam.handle.PatchHandle.set_aside`): each measuring patch streams the blocks it streams from its host
copies, and the blocks it keeps resident are lent to the GPU for its step (:func:`gradseam.handle.lending`).

The planner is a tool (it measures, caches and searches: :mod:`gradseam.tools.auto_planner`), and the runtime never
imports the tools: the package's entry point hands it over through :func:`use_planner`, so this module
knows only its signature. A planner may run the model (forward and backward at shallow depths) inside
the pre-hook; while it does, the handle is inactive (a patch it makes does not replace this one) and this
hook does nothing, and everything the user can see is put back: parameter and input gradients, and the
random number generators' states.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from .config import CheckpointConfig
from .errors import GradseamError

if TYPE_CHECKING:
    from torch import nn

# What a model patched with "auto" runs until it is planned: itself (nothing to checkpoint without gradients).
UNPLANNED = CheckpointConfig(gradient_checkpointing=False)
# ... unless its weights are more than the GPU may hold: then every block's frozen weights stay in host memory
# from patch time (a model built on the CPU moves to the GPU without them), until the plan keeps some resident.
UNPLANNED_STREAMED = CheckpointConfig.from_dict(
    {"gradient_checkpointing": True, "gradient_checkpointing_stream_weights": "all"})


@dataclass(frozen=True)
class Request:
    """What the planner is asked: plan ``model`` for a step called with ``inputs`` within the budgets."""

    model: nn.Module
    inputs: Mapping[str, Any]  # the step's forward arguments, by name
    gpu_gib: float | None  # gradient_checkpointing_gpu_memory (None: the planner's default)
    host_gib: float | None  # gradient_checkpointing_host_memory (None: the planner's default)
    family: Any
    streamed: bool = False  # every block's frozen weights are in host memory (a model larger than its GPU budget)
    # ... and they went there at the first step, because nothing could be measured beside them (NoRoomBesideWeights)
    streamed_for_room: bool = False


@dataclass(frozen=True)
class Planned:
    """The planner's answer: the explicit config every block then runs, and how it was arrived at."""

    config: CheckpointConfig
    source: str  # "measured", "cached" or "default" (nothing could be measured)
    report: str  # what was measured or read, the plan and what it beat, in a few lines
    # what the plan is predicted to take: "gpu_gib" (the step's GPU peak, everything on the GPU counted), "host_gib"
    # (pinned host memory, streamed weights included), "step_ms"; None for the default (nothing measured)
    predicted: dict[str, float] | None = None
    # the same figures as the plan measured them, run once on the whole model before its first step (None: not run,
    # as on the CPU or under torch.distributed with the plan not in the cost cache), and on a GPU "alloc_retries",
    # the caching allocator's retries in that step
    measured: dict[str, float] | None = None


Planner = Callable[[Request], Planned]


class NoRoomBesideWeights(GradseamError):
    """Raised by a planner asked for a model whose weights are on the GPU when no candidate could be measured beside
    them: every one ran out of memory, even cut to a block or two, with the whole model's weights resident. The
    model's step cannot run resident, and nothing says how much of it would have to stream; the planning hook then
    keeps every block's frozen weights in host memory, as for a model larger than its GPU, and asks again with
    ``Request.streamed``: each candidate is then measured with only the blocks it runs on the GPU. The message is
    what the user reads where the weights cannot stream (quantized, say)."""


_planner: Planner | None = None


def use_planner(planner: Planner | None) -> Planner | None:
    """Make ``planner`` the one ``"auto"`` calls; returns the previous one (tests put it back)."""
    global _planner
    previous, _planner = _planner, planner
    return previous


class AutoPlanning:
    """The pre-hook (with keyword arguments) that plans a model patched with ``"auto"`` at its first training
    forward; registered first among the model's pre-hooks, so the handle's own pre-hook sees the planned
    regions."""

    def __init__(self, handle: Any, config: CheckpointConfig) -> None:  # a gradseam.handle.PatchHandle
        self.handle = handle
        self.requested = config  # the keys as given, "auto" among them
        self.planned: Planned | None = None
        self._busy = False
        self._sizes: dict[str, int] | None = None  # each tensor input's element count at the planned step

    @property
    def config(self) -> CheckpointConfig | None:
        """The explicit config the model runs since it was planned (None before): give it to ``patch()`` to
        run the same plan without planning."""
        return self.planned.config if self.planned is not None else None

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        import torch

        if self._busy or not self.handle.active or not torch.is_grad_enabled():
            return
        if self.planned is not None:
            if self._sizes is not None:
                self._check_shapes(module, args, kwargs)
            return
        if not any(p.requires_grad for p in module.parameters()):
            return  # nothing trains through this forward: plan when something does
        planner = _planner
        if planner is None:
            raise GradseamError(
                "gradient_checkpointing_backend \"auto\" has no planner: import gradseam (its package entry point "
                "installs it) rather than its modules alone, or pass an explicit config."
            )
        streamed = self.handle.weights is not None  # a model larger than its GPU: every block's weights on the host
        request = Request(module, _by_name(module, args, kwargs), self.requested.gradient_checkpointing_gpu_memory,
                          self.requested.gradient_checkpointing_host_memory, self.handle.family, streamed)
        try:
            planned = self._ask(planner, module, request)
        except NoRoomBesideWeights as exc:
            self._hold_weights_in_host_memory(exc)
            try:
                planned = self._ask(planner, module, replace(request, streamed=True, streamed_for_room=True))
            except BaseException:
                self.handle.adopt(UNPLANNED)  # unplanned, the weights go back where they were
                raise
        self.handle.adopt(planned.config)
        self.planned = planned
        self._sizes = _sizes(request.inputs)

    def _ask(self, planner: Planner, module: nn.Module, request: Request) -> Planned:
        self._busy = True
        self.handle.active = False  # a patch the planner makes to measure must not replace this one
        try:
            from .modules import untouched  # here, not at import: `import gradseam` stays free of torch

            # what this patch runs until planned steps aside: the measuring patches checkpoint (and stream the
            # blocks they keep) themselves
            with self.handle.set_aside(), untouched(module, request.inputs):
                return planner(request)
        finally:
            self._busy = False
            self.handle.active = True

    def _hold_weights_in_host_memory(self, crowded: NoRoomBesideWeights) -> None:
        """Every block's frozen weights to host memory (:data:`UNPLANNED_STREAMED`), for the planner to measure each
        candidate with only its own blocks on the GPU; refused (weights that cannot stream), the planner's message
        stands, with the reason. Asked twice (the planner said so of a model already streamed), it stands alone."""
        from .errors import UnsupportedStrategyError

        if self.handle.weights is not None:
            raise crowded
        try:
            self.handle.adopt(UNPLANNED_STREAMED)
        except UnsupportedStrategyError as refused:
            raise GradseamError(f"{crowded} Its blocks' weights cannot stream from host memory to make room: "
                                f"{refused}") from None

    def _check_shapes(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        """Warn, once per input and size, when a training step's input is larger than the one the plan was made for
        (aspect-ratio buckets): its activations grow with it, and the plan was fitted to the budgets without them."""
        assert self._sizes is not None
        for name, numel in _sizes(_by_name(module, args, kwargs)).items():
            planned = self._sizes.get(name)
            if planned is not None and numel > planned:
                from .errors import warn_once

                warn_once(
                    f"gradseam: gradient_checkpointing_backend \"auto\" planned {type(module).__name__} for its first "
                    f"training step, where {name} held {planned:,} elements; this step's holds {numel:,} "
                    f"({numel / planned:.2f}x), and its activations grow with it beyond what the plan fitted into the "
                    "budgets. Make the first batch the largest bucket, or patch with the keys each bucket's plan "
                    "prints (handle.auto.config).")

    def describe(self) -> str:
        if self.planned is None:
            held = (" (the model being larger than the GPU budget, every block's frozen weights stay in host memory "
                    "until then, and are planned streamed)" if self.handle.weights is not None else "")
            return ("gradient_checkpointing_backend \"auto\": not planned yet; every block is planned at the first "
                    f"forward with gradients, from its inputs' shapes{held}")
        return f"gradient_checkpointing_backend \"auto\" ({self.planned.source}): {self.planned.report}"


def unplanned(model: nn.Module, config: CheckpointConfig) -> CheckpointConfig:
    """What ``model`` runs from patch time until ``"auto"`` plans it: itself (:data:`UNPLANNED`), or, for a model
    on the CPU whose weights are more than the GPU memory the plan may use, every block's frozen weights kept in
    host memory (:data:`UNPLANNED_STREAMED`). ``"auto"`` plans at the first training step, on the GPU: such a model
    would run out of memory as it moves there, before anything is planned. Streamed from patch time, it moves
    without them, and the plan then chooses each block's activations with its weights streamed."""
    import torch

    from .modules import gpu_limit_bytes
    from .offload import cpu_allowed

    tensors = [*model.parameters(), *model.buffers()]
    if not tensors or any(t.device.type != "cpu" for t in tensors):
        return UNPLANNED
    if not (torch.cuda.is_available() or cpu_allowed()):
        return UNPLANNED  # nowhere to stream to: the planner says what it falls back to
    budget = config.gradient_checkpointing_gpu_memory
    if budget is None:
        limit = gpu_limit_bytes()  # the card's memory, within the process's fraction
        if limit is None:
            return UNPLANNED
        budget = limit / 2**30
    weights = sum(t.numel() * t.element_size() for t in tensors) / 2**30
    return UNPLANNED_STREAMED if weights > budget else UNPLANNED


def _sizes(inputs: Mapping[str, Any]) -> dict[str, int]:
    """Each top-level tensor input's element count (what sets a step's activations: tokens, frames, batch)."""
    return {name: value.numel() for name, value in inputs.items() if hasattr(value, "numel") and hasattr(value, "shape")}


def _by_name(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The forward's arguments as keywords (the measurement calls ``model(**inputs)``)."""
    if not args:
        return dict(kwargs)
    import inspect

    try:
        bound = inspect.signature(module.forward).bind(*args, **kwargs)
    except TypeError as exc:
        raise GradseamError(f"gradient_checkpointing_backend \"auto\" could not name the forward's arguments of "
                            f"{type(module).__name__} ({exc}); call the model with keyword arguments.") from None
    return dict(bound.arguments)
