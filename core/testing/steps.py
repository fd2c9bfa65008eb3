"""Cases, steps and their comparison: the unit every check of the kit is made of.

A :class:`Case` says how to build a family's tiny model and feed it; :func:`run_step` runs one
training step and keeps everything it touched (outputs, every input and parameter gradient, the bytes
kept between forward and backward); :func:`assert_same_step` compares two steps, to the bit by
default. Nothing here knows about patching: the checks (:mod:`gradseam.testing.checks`) run these on
an unpatched and a patched model and compare.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..tools.measure import count_saved_bytes

Inputs = dict[str, Any]


def randn(g: torch.Generator, *shape: int, grad: bool = False) -> torch.Tensor:
    """A CPU tensor of standard normals from ``g`` (a Case's inputs draw from it), optionally a leaf
    that requires grad: every family's tiny inputs are built from these."""
    return torch.randn(*shape, generator=g).requires_grad_(grad)


def _first(out: Any) -> Any:
    return out[0]


@dataclass
class Case:
    """A tiny, deterministic instance of a family's model and a way to feed it.

    ``build()`` must give the same model under the same ``torch.manual_seed(seed)`` (the kit seeds
    before calling it, and may build a case more than once). ``inputs(generator)`` must return fresh
    tensors on every call (the same values for the same generator seed); tensors that should receive
    gradients must have ``requires_grad=True``. ``output`` picks the tensor(s) the loss is computed on
    from the model's return value.
    """

    name: str
    build: Callable[[], nn.Module]
    inputs: Callable[[torch.Generator], Inputs]
    output: Callable[[Any], torch.Tensor | tuple[torch.Tensor, ...]] = field(default=_first)
    seed: int = 0

    def fresh(self) -> nn.Module:
        """The model as every check builds it: ``build()`` right after ``torch.manual_seed(seed)``."""
        torch.manual_seed(self.seed)
        return self.build()

    def twins(self) -> tuple[nn.Module, nn.Module]:
        """Two models with the same weights: one to patch, one to run unpatched beside it."""
        model = self.fresh()
        twin = self.build()
        twin.load_state_dict(model.state_dict())
        return model, twin


@dataclass
class Step:
    """What one training step touched: outputs, the gradient of every input and every parameter that got
    one, and the bytes kept between forward and backward (0 when not counted)."""

    outputs: tuple[torch.Tensor, ...]
    input_grads: dict[str, torch.Tensor]
    param_grads: dict[str, torch.Tensor]
    saved_bytes: int

    def copy(self) -> Step:
        """A copy whose tensors are its own (a caller may change them in place)."""
        return Step(tuple(o.clone() for o in self.outputs), {k: v.clone() for k, v in self.input_grads.items()},
                    {k: v.clone() for k, v in self.param_grads.items()}, self.saved_bytes)


def as_tuple(value: torch.Tensor | tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """What a Case's ``output`` picked, as a tuple of tensors."""
    return value if isinstance(value, tuple) else (value,)


def _leaves(inputs: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
    """Every tensor of the inputs with its path: ``hidden_states``, and inside lists, tuples and dicts
    ``vision_tokens[0]`` or ``cache['key']``, so a model that takes its latents in a list has their gradients
    compared too."""
    found: list[tuple[str, torch.Tensor]] = []

    def walk(path: str, value: Any) -> None:
        if isinstance(value, torch.Tensor):
            found.append((path, value))
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                walk(f"{path}[{i}]", item)
        elif isinstance(value, dict):
            for key, item in value.items():
                walk(f"{path}[{key!r}]", item)

    for name, value in inputs.items():
        walk(name, value)
    return found


def run_step(model: nn.Module, case: Case, *, seed: int = 1, count_bytes: bool = True) -> Step:
    """One forward + backward with ``sum(out.square().mean())`` as the loss; returns everything it touched.

    ``count_bytes=False`` runs the forward without the byte-counting saved-tensor hooks, for tests
    that must see gradseam's own hooks alone (``saved_bytes`` is then 0).
    """
    model.zero_grad(set_to_none=True)
    inputs = case.inputs(torch.Generator().manual_seed(seed))
    with count_saved_bytes(model) if count_bytes else nullcontext([0]) as saved:
        outputs = as_tuple(case.output(model(**inputs)))
    loss = sum(o.float().square().mean() for o in outputs)
    loss.backward()  # type: ignore[union-attr]
    input_grads = {
        k: v.grad.detach().clone()
        for k, v in _leaves(inputs)
        if v.requires_grad and v.is_leaf and v.grad is not None
    }
    param_grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return Step(tuple(o.detach().clone() for o in outputs), input_grads, param_grads, saved[0])


def assert_same_step(expected: Step, got: Step, *, atol: float = 0.0, what: str = "") -> None:
    """Outputs, every input gradient and every parameter gradient must match (to the bit by default)."""
    prefix = f"{what}: " if what else ""

    def close(a: torch.Tensor, b: torch.Tensor) -> bool:
        if atol == 0.0:
            return torch.equal(a, b)
        return torch.allclose(a, b, atol=atol, rtol=atol)

    assert len(expected.outputs) == len(got.outputs), f"{prefix}number of outputs differs"
    for i, (a, b) in enumerate(zip(expected.outputs, got.outputs)):
        assert close(a, b), f"{prefix}output {i} differs by {(a - b).abs().max().item():.3e}"
    assert expected.input_grads.keys() == got.input_grads.keys(), (
        f"{prefix}inputs with gradients differ: {sorted(expected.input_grads)} vs {sorted(got.input_grads)}"
    )
    for name, a in expected.input_grads.items():
        b = got.input_grads[name]
        assert close(a, b), f"{prefix}gradient of input {name!r} differs by {(a - b).abs().max().item():.3e}"
    assert expected.param_grads.keys() == got.param_grads.keys(), (
        f"{prefix}parameters with gradients differ: "
        f"{sorted(set(expected.param_grads) ^ set(got.param_grads))[:5]}"
    )
    for name, a in expected.param_grads.items():
        b = got.param_grads[name]
        assert close(a, b), f"{prefix}gradient of parameter {name!r} differs by {(a - b).abs().max().item():.3e}"
