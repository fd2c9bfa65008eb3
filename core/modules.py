"""Finding things in a module tree: a dotted path, the block inside a wrapper, a model's device, the tensors
in a model's (nested) inputs or outputs; and putting back what measuring steps on a user's model change.

Small and free of policy, so that every layer above (planning, the kinds' refusals, the run layer,
the handle, the tools) asks these questions one way. Imports nothing of gradseam.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn


def resolve(root: Any, path: str) -> Any:
    """The object at dotted ``path`` under ``root`` (``"transformer_blocks"``, ``"attn.to_q"``), or None."""
    obj: Any = root
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def is_optimized(module: nn.Module) -> bool:
    """Whether ``module`` is ``torch.compile``'s wrapper (``OptimizedModule``), without importing dynamo."""
    return type(module).__name__ == "OptimizedModule" and type(module).__module__.startswith("torch._dynamo")


def unwrap(module: nn.Module) -> nn.Module:
    """The block inside torch's activation-checkpoint wrapper(s) or ``torch.compile``'s ``OptimizedModule``
    (``blocks[i] = torch.compile(blocks[i])``), or the module itself."""
    while True:
        inner = getattr(module, "_checkpoint_wrapped_module", None)
        if not isinstance(inner, nn.Module):
            inner = module._modules.get("_orig_mod") if is_optimized(module) else None
        if not isinstance(inner, nn.Module):
            return module
        module = inner


def gpu_limit_bytes(device: torch.device | None = None) -> int | None:
    """What this process may allocate on CUDA ``device`` (default: the current one): the card's memory within the
    per-process fraction (``torch.cuda.set_per_process_memory_fraction``, how a smaller card is simulated), or None
    without CUDA or for another device."""
    if not torch.cuda.is_available() or (device is not None and device.type != "cuda"):
        return None
    index = torch.cuda.current_device() if device is None or device.index is None else device.index
    fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    return int((fraction(index) if fraction is not None else 1.0) * torch.cuda.get_device_properties(index).total_memory)


def device_type(module: nn.Module) -> str:
    """The device type of a module's first parameter ("cuda", "cpu"); "cpu" for a module without any."""
    for p in module.parameters():
        return p.device.type
    return "cpu"


def tensors(obj: Any) -> list[torch.Tensor]:
    """Every tensor in a model's inputs or outputs: tensors, tuples and lists, dicts and diffusers ``BaseOutput``."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, Mapping):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        return [t for item in obj for t in tensors(item)]
    return []


def grad_leaves(inputs: Any) -> list[torch.Tensor]:
    """The leaf tensors of ``inputs`` that gather gradients (``.grad``): the latents a step differentiates."""
    return [t for t in tensors(inputs) if t.requires_grad and t.is_leaf]


class untouched:  # noqa: N801 - a context manager, named for how it reads: `with untouched(model, inputs):`
    """Puts back what measuring steps on a user's own model change that the user sees: every parameter's and
    input leaf's ``.grad`` (a measured backward accumulates into them; a trainer that zeroes its gradients after
    ``optimizer.step()``, as diffusers' scripts do, would otherwise add them to its first step) and the CPU and CUDA
    generators' states (a measured forward draws from them: dropout, noise). Used by ``"auto"``'s planning and by
    :func:`gradseam.advise`."""

    def __init__(self, model: nn.Module, inputs: Mapping[str, Any]) -> None:
        self.grads = [(t, t.grad) for t in [*model.parameters(), *grad_leaves(inputs)]]  # nested inputs too
        self.cpu_rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None

    def __enter__(self) -> None:
        for tensor, _ in self.grads:
            tensor.grad = None

    def __exit__(self, *exc: object) -> None:
        for tensor, grad in self.grads:
            tensor.grad = grad
        torch.set_rng_state(self.cpu_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)
