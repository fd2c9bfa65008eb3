"""Real-size workloads: a family's preset model with random weights, and one batch of its inputs.

Nothing here names a family: the model class comes from the family's declared model classes, the
constructor config and the input builder from its :class:`~gradseam.family.Preset`. Weights are
random (nothing is downloaded), bf16 and frozen; the inputs' latents require grad, as in a LoRA
or full fine-tune step where the loss flows back through the whole stack.

``layers=K`` keeps the first K blocks of every declared block list, so a large model fits a
quick run; the per-block numbers stay real, the totals shrink. The protocol's loss is
``sum(out.float().square().mean())`` over every floating output tensor.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .errors import GradseamError
from .family import Family, Preset, class_name


def find_family(name: str) -> Family:
    import gradseam

    families = {f.name: f for f in gradseam.families()}
    if name not in families:
        raise GradseamError(f"no installed family {name!r}; installed: {', '.join(sorted(families)) or 'none'}.")
    return families[name]


def find_preset(family: Family, name: str | None) -> tuple[str, Preset]:
    if not family.presets:
        raise GradseamError(f"family {family.name!r} declares no presets, so it has no real-size workload.")
    if name is None:
        name = next(iter(family.presets))
    if name not in family.presets:
        raise GradseamError(
            f"family {family.name!r} has no preset {name!r}; presets: {', '.join(family.presets)}."
        )
    return name, family.presets[name]


def model_class(family: Family) -> type:
    """The first declared model class that is importable (bare names are looked up in ``diffusers``)."""
    tried = []
    for ref in family.models:
        if isinstance(ref, type):
            return ref
        module, _, attr = ref.rpartition(".")
        try:
            found = getattr(importlib.import_module(module or "diffusers"), attr, None)
        except ImportError:
            found = None
        if isinstance(found, type):
            return found
        tried.append(class_name(ref))
    raise GradseamError(
        f"family {family.name!r}: none of its model classes ({', '.join(tried)}) can be imported from the "
        "installed diffusers, so its preset cannot be built here. Install a diffusers that has the class."
    )


def resolve(root: Any, path: str) -> Any:
    for part in path.split("."):
        root = getattr(root, part, None)
        if root is None:
            return None
    return root


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
    done = {}
    for block_list in family.block_lists:
        blocks = resolve(model, block_list.path)
        if blocks is None:
            continue
        parent_path, _, attr = block_list.path.rpartition(".")
        parent = resolve(model, parent_path) if parent_path else model
        kept = list(blocks)[:layers]
        setattr(parent, attr, nn.ModuleList(kept))
        done[block_list.path] = (len(kept), len(blocks))
    return done


def tensors(obj: Any) -> list[torch.Tensor]:
    """Every tensor in a model output (tensors, tuples/lists, dicts and diffusers ``BaseOutput``)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, Mapping):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        return [t for item in obj for t in tensors(item)]
    return []


def default_loss(out: Any) -> torch.Tensor:
    """``sum(t.float().square().mean())`` over the floating output tensors."""
    found = [t for t in tensors(out) if t.is_floating_point()]
    if not found:
        raise GradseamError(f"the model output ({type(out).__name__}) holds no floating tensor to build a loss from.")
    return sum(t.float().square().mean() for t in found)


def grad_leaves(inputs: Any) -> list[torch.Tensor]:
    return [t for t in tensors(inputs) if t.requires_grad and t.is_leaf]


def make_step(
    model: nn.Module, inputs: Mapping[str, Any], loss_fn: Callable[[Any], torch.Tensor] | None = None
) -> Callable[[], None]:
    """One forward + backward; input grads are dropped first so every step allocates the same."""
    loss_fn = loss_fn or default_loss
    leaves = grad_leaves(inputs)

    def step() -> None:
        for t in leaves:
            t.grad = None
        loss_fn(model(**inputs)).backward()

    return step


@dataclass
class Workload:
    family: Family
    preset_name: str
    preset: Preset
    model: nn.Module
    truncated: dict[str, tuple[int, int]] = field(default_factory=dict)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    dtype: torch.dtype = torch.bfloat16

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

    def label(self, tokens: int) -> str:
        cut = f", {self.layers_note}" if self.truncated else ""
        return f"{self.family.name} {self.preset_name} ({tokens} seq{cut})"


def build(
    family: str | Family,
    preset: str | None = None,
    *,
    layers: int | None = None,
    device: str | torch.device = "cuda",
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
) -> Workload:
    """The preset's model with random weights directly on ``device``, truncated, in ``dtype``, frozen."""
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
    with torch.device(device):
        model = cls(**the_preset.config)
    truncated = truncate(model, fam, layers) if layers else {}
    model = model.to(dtype).requires_grad_(False)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the dropped blocks and the fp32 copies
    return Workload(fam, preset_name, the_preset, model, truncated, device, dtype)


def sequence_length(model: nn.Module, family: Family, inputs: Mapping[str, Any]) -> int:
    """The longest sequence a first block of any declared list sees (one forward without grad)."""
    seen: list[int] = []
    hooks = []

    def record(module: nn.Module, args: tuple, kwargs: dict) -> None:
        first = next((t for t in [*args, *kwargs.values()] if isinstance(t, torch.Tensor) and t.dim() >= 3), None)
        if first is not None:
            seen.append(first.shape[-2])

    for block_list in family.block_lists:
        blocks = resolve(model, block_list.path)
        if blocks is not None and len(blocks):
            hooks.append(blocks[0].register_forward_pre_hook(record, with_kwargs=True))
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        for h in hooks:
            h.remove()
    return max(seen, default=0)
