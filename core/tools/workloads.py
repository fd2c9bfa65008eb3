"""Real-size workloads: a family's preset model with random weights, and one batch of its inputs.

Nothing here names a family: the model class comes from the family's declared model classes, the
constructor config and the input builder from its :class:`~gradseam.family.Preset`. Weights are
random (nothing is downloaded), bf16 and frozen; the inputs' latents require grad, as in a LoRA
or full fine-tune step where the loss flows back through the whole stack.

``depth=d`` keeps the blocks of ``d`` units of depth (every list in its real proportion, see
:mod:`gradseam.tools.depth`), so a large model fits a quick run and two depths give each block's
growth; ``layers=K`` keeps the first K blocks of every list (the older, cruder cut). The step and
its loss live in :mod:`gradseam.tools.measure`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..errors import GradseamError
from ..family import Family, Preset
from ..modules import resolve
from .bases import add_lora, quantize, weight_bytes
from .checks import find_family, find_preset, model_class
from .depth import DepthPlan, cut, plan_for


def blocks(model: nn.Module, family: Family) -> list[nn.Module]:
    """Every block of every declared block list the model has, in declaration order (for sharding)."""
    found = []
    for block_list in family.block_lists:
        found.extend(resolve(model, block_list.path) or ())
    return found


def truncate(model: nn.Module, family: Family, layers: int) -> dict[str, tuple[int, int]]:
    """Keep the first ``layers`` blocks of every declared block list; ``{path: (kept, total)}``."""
    if layers < 1:
        raise ValueError(f"layers must be >= 1, got {layers}.")
    totals = {bl.path: len(found) for bl in family.block_lists if (found := resolve(model, bl.path)) is not None}
    cut(model, {path: layers for path in totals})
    return {path: (min(layers, n), n) for path, n in totals.items()}


@dataclass
class Workload:
    family: Family
    preset_name: str
    preset: Preset
    model: nn.Module
    truncated: dict[str, tuple[int, int]] = field(default_factory=dict)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    dtype: torch.dtype = torch.bfloat16
    plan: DepthPlan = field(default_factory=lambda: DepthPlan({}))  # of the preset's full model
    depth: int | None = None  # the depth kept (None: every block, or ``layers``)
    fit_depths: tuple[int, int] | None = None  # with ``depths=``: the two depths to fit from
    dropped_gib: float = 0.0  # weights of the blocks truncation dropped, as stored (static memory at full depth)
    base: str | None = None  # a quantized base (gradseam.tools.bases), or None for ``dtype`` weights
    lora: int | None = None  # the rank of the LoRA trained on it, or None (frozen weights, latents' gradients)

    def inputs(self, tokens: int | None = None) -> dict[str, Any]:
        if self.preset.make_inputs is None:
            raise GradseamError(
                f"preset {self.family.name}/{self.preset_name} has no make_inputs builder, so gradseam "
                "cannot build its real-size inputs."
            )
        torch.manual_seed(0)
        return dict(self.preset.make_inputs(self.model, self.device, self.dtype, tokens, **self.preset.inputs))

    @property
    def layers_note(self) -> str:
        if not self.truncated:
            return "all blocks"
        return "layers truncated: " + ", ".join(f"{p} {k}/{n}" for p, (k, n) in self.truncated.items())

    @property
    def weights_note(self) -> str:
        """How the weights are stored and trained, for labels: '' for frozen ``dtype`` weights."""
        return "".join((f", {self.base}" if self.base else "", f", LoRA r={self.lora}" if self.lora else ""))

    def label(self, tokens: int) -> str:
        cut = f", {self.layers_note}" if self.truncated else ""
        return f"{self.family.name} {self.preset_name} ({tokens} seq{cut}{self.weights_note})"


def build(
    family: str | Family,
    preset: str | None = None,
    *,
    layers: int | None = None,
    depth: int | str | None = None,
    depths: str | tuple[int, int] | None = None,
    device: str | torch.device = "cuda",
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    base: str | None = None,
    lora: int | None = None,
) -> Workload:
    """The preset's model with random weights directly on ``device``, truncated, in ``dtype``, frozen.

    ``depth``: keep that many units of depth; ``"fit"`` keeps the deeper of the two fit depths
    (``depths``, as ``"2,4"`` or a pair; default two small ones), recorded in ``fit_depths``.
    ``base``: quantize the blocks' Linear layers as that base (:data:`gradseam.tools.bases.BASES`);
    ``lora``: train a LoRA of that rank on the attention projections (:func:`gradseam.tools.bases.add_lora`).
    """
    if layers is not None and depth is not None:
        raise ValueError("layers= and depth= exclude each other: layers keeps the first K of every list, "
                         "depth keeps every list in its real proportion.")
    fam = find_family(family) if isinstance(family, str) else family
    preset_name, the_preset = find_preset(fam, preset)
    cls = model_class(fam)
    device = torch.device(device)
    if device.type == "cuda":
        # On the H200 used for docs/benchmarks.md (torch 2.11 + CUDA 13), cuDNN's attention backward
        # failed for Flux's real shapes even without gradseam ("Expected mha_graph.execute(...)", then
        # illegal memory accesses); the flash kernel serves every family, so the workloads use it.
        torch.backends.cuda.enable_cudnn_sdp(False)
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    if device.type == "cuda":
        # built directly in the benchmark dtype: FLUX.2 dev (32B) would need 128 GB in float32 first
        torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = cls(**the_preset.config)
    finally:
        torch.set_default_dtype(default)
    plan = plan_for(model, fam)
    fit_depths = None
    if depth == "fit" or depths is not None:
        fit_depths = plan.fit_depths(depths)
        if depth == "fit":
            depth = fit_depths[1]
    if isinstance(depth, str):
        raise ValueError(f"depth must be a number of units or 'fit', got {depth!r}.")
    before = sum(p.numel() for p in model.parameters())
    if depth is not None:
        truncated = truncate_to(model, plan, depth)
    else:
        truncated = truncate(model, fam, layers) if layers else {}
    dropped = before - sum(p.numel() for p in model.parameters())
    model = keep_float32(model.to(dtype)).requires_grad_(False)
    stored = dtype.itemsize  # bytes per parameter as stored, for the dropped blocks' weights
    if base is not None:
        kept = blocks(model, fam)
        numel = sum(p.numel() for b in kept for p in b.parameters())
        quantize(kept, base, dtype)
        stored = sum(weight_bytes(b) for b in kept) / max(numel, 1)
    if lora is not None:
        add_lora(model, lora, dtype)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the dropped blocks and the fp32 copies
    return Workload(fam, preset_name, the_preset, model, truncated, device, dtype, plan, depth, fit_depths,
                    dropped * stored / (1 << 30), base, lora)


def truncate_to(model: nn.Module, plan: DepthPlan, depth: int) -> dict[str, tuple[int, int]]:
    """Keep the blocks of ``depth`` units for good (dropping the rest frees their weights)."""
    return {path: (len(getattr(parent, attr)), len(original)) for path, parent, attr, original
            in cut(model, plan.counts(depth))}


def keep_float32(model: nn.Module) -> nn.Module:
    """Cast back to float32 the modules the class keeps in float32 (``_keep_in_fp32_modules``).

    ``from_pretrained(torch_dtype=...)`` does this, ``.to(dtype)`` does not; without it a model that
    feeds such a module float32 on purpose (Kandinsky 5's time embedding) fails in bf16 with a dtype
    mismatch, and every other family would be measured in a precision its users never train in."""
    keep = set(getattr(type(model), "_keep_in_fp32_modules", None) or ())
    if keep:
        for name, module in model.named_modules():
            if keep.intersection(name.split(".")):
                module.float()
    return model


class _AllSeen(Exception):
    """Raised by :func:`sequence_length`'s hooks once every list's first block has been seen: the rest of the
    forward is not needed."""


def sequence_length(model: nn.Module, family: Family, inputs: Mapping[str, Any]) -> int:
    """The longest sequence a first block of any declared list sees (a forward without grad, stopped there).

    The longest axis but the last (the hidden size) of the block's first tensor argument: batch-first
    ``(batch, sequence, hidden)`` and sequence-first ``(sequence, batch, hidden)`` layouts (ERNIE-Image)
    alike, since a batch is never longer than its sequence.

    The forward stops before the last list's first block runs: running the blocks added nothing to the
    answer, and at a preset's full size some cannot run eagerly at all (Kandinsky 6 SR's flex attention,
    called outside ``torch.compile``, materialises its whole score matrix: 236 GiB asked for on an H100)."""
    seen: list[int] = []
    hooks = []
    waiting: set[int] = set()

    def record(module: nn.Module, args: tuple, kwargs: dict) -> None:
        first = next((t for t in [*args, *kwargs.values()] if isinstance(t, torch.Tensor) and t.dim() >= 3), None)
        if first is not None:
            seen.append(max(first.shape[:-1]))
        waiting.discard(id(module))
        if not waiting:
            raise _AllSeen

    for block_list in family.block_lists:
        blocks = resolve(model, block_list.path)
        if blocks is not None and len(blocks):
            hooks.append(blocks[0].register_forward_pre_hook(record, with_kwargs=True))
            waiting.add(id(blocks[0]))
    try:
        with torch.no_grad():
            model(**inputs)
    except _AllSeen:
        pass
    finally:
        for h in hooks:
            h.remove()
    return max(seen, default=0)
