"""Quantized bases in the kit: a case's model with its blocks quantized, against the same model unpatched.

Most LoRA training on Flux, Wan or Qwen-Image runs on a quantized, frozen base (torchao's fp8 and int8,
optimum-quanto's qfloat8, bitsandbytes' NF4; :mod:`gradseam.tools.bases` makes each). Such weights are
not plain tensors: wrapper tensor subclasses keep their bytes in inner tensors, bitsandbytes hangs its
block scales on the parameter. What gradseam must get right there is what it must get right anywhere
(the same outputs and gradients as the unpatched model, to the bit on the CPU), plus two things only a
quantized base can break: the offload engine must tell the quantized weights (and their inner and side
tensors) from activations, and a compiled block must compile with them.

:func:`quantized_case` turns a :class:`~gradseam.testing.Case` into the same case with the ``nn.Linear``
layers of every block quantized as a base makes them (and frozen); :func:`check_quantized` runs
:func:`~gradseam.testing.check_strategy` on it (the reference cache digests a quantized weight through
its inner and side tensors, and builds the twin again under the seed: a quantized model cannot always be
deep-copied). :class:`~gradseam.testing.ConformanceSuite` runs it as
``test_quantized_base`` for the bases in ``quantized_bases``. The libraries are optional
(``pip install 'gradseam[quant]'``): :func:`unavailable` says why a base cannot run here, and nothing in
this module imports one before a base is applied.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..config import CheckpointConfig
from ..offload.state import plain_parts
from ..tools.bases import BASES, quantize
from .checks import ParityReport, check_strategy
from .references import reference
from .steps import Case

# The suite's default bases: one wrapper tensor subclass (its bytes in inner tensors) and one base whose
# parameter carries its block scales as side tensors: the two ways a weight hides its bytes from a check.
QUANTIZED_BASES: tuple[str, ...] = ("torchao-int8", "bnb-nf4")
INSTALL = "pip install 'gradseam[quant]'"

Train = Callable[[nn.Module], None]


class UnpatchedFailure(Exception):
    """The quantized model fails unpatched: the base's library cannot run this family's model (on this
    machine), so there is no reference to compare gradseam with. Not a failure of gradseam."""


def unavailable(base: str) -> str | None:
    """Why ``base`` cannot run here (its library is not installed), or None."""
    found = BASES.get(base)
    if found is None:
        raise KeyError(f"unknown quantized base {base!r}; the bases are: {', '.join(BASES)}")
    if not found.available():
        return f"quantized base {base!r} needs {found.library.split('.')[-1]}, which is not installed: {INSTALL}"
    return None


def is_quantized(p: torch.Tensor) -> bool:
    """A weight a base made: a tensor subclass (a wrapper with inner tensors, or a parameter subclass such as
    bitsandbytes' ``Params4bit``), or not floating point; plain floating-point parameters are not."""
    if type(p) is not nn.Parameter or not p.is_floating_point():
        return True
    parts = plain_parts(p)
    return len(parts) != 1 or parts[0] is not p


def train_the_rest(model: nn.Module) -> None:
    """The kit's default trainable part: every plain floating-point parameter (the norms and biases inside
    the blocks, the embedders and the output projection), everything the base quantized frozen. Gradients
    reach parameters inside every checkpointed block and flow back through every quantized layer, with no
    adapter library needed."""
    for p in model.parameters():
        p.requires_grad_(not is_quantized(p))


def quantized_case(case: Case, base: str, *, train: Train | None = None) -> Case:
    """``case`` with the ``nn.Linear`` layers of every block of the model's family quantized as ``base``
    makes them (:func:`gradseam.tools.bases.quantize`, which freezes them); then ``train(model)`` picks what
    trains (a LoRA, say), by default :func:`train_the_rest`. Deterministic under the case's seed, as the
    kit needs: build it twice for twins."""
    from ..patcher import family_for
    from ..tools.workloads import blocks

    def build() -> nn.Module:
        model = case.build()
        dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
        quantize(blocks(model, family_for(model)), base, dtype)
        (train or train_the_rest)(model)
        return model

    return Case(f"{case.name}+{base}", build, case.inputs, case.output, case.seed)


_CASES: dict[tuple[int, str, int], tuple[Case, Case, Train | None]] = {}  # the quantized case, once per case


def _quantized_once(case: Case, base: str, train: Train | None) -> Case:
    """:func:`quantized_case`, made once per (case, base, trainable part): the kit's reference cache keys
    a case by its callables, so one quantized case reuses its unpatched step across configurations."""
    key = (id(case), base, id(train))
    found = _CASES.get(key)
    if found is None or found[0] is not case or found[2] is not train:
        found = _CASES[key] = (case, quantized_case(case, base, train=train), train)  # holds case: ids stay
    return found[1]


def check_quantized(
    case: Case,
    base: str,
    config: CheckpointConfig | dict[str, Any],
    *,
    train: Train | None = None,
    atol: float = 0.0,
    whole: bool = False,
) -> ParityReport:
    """:func:`~gradseam.testing.check_strategy` on ``case`` with its blocks quantized as ``base`` makes them
    (:func:`quantized_case`): the patched model against its unpatched twin, to the bit (the compiled
    tolerance for compiled rows), fewer bytes kept with the quantized weights not counted, an offload
    that moved something, an exact ``remove()``. Run offload configurations of a CPU model inside
    :func:`gradseam.offload.cpu_test_mode`, as for ``check_strategy``.

    Raises :class:`UnpatchedFailure` (before patching anything) when the quantized model does not run
    unpatched; the suite skips such a row, naming the error."""
    qcase = _quantized_once(case, base, train)
    try:
        reference(qcase, qcase.fresh())  # the unpatched step check_strategy compares with, cached
    except Exception as exc:
        first = str(exc).splitlines()[0][:300] if str(exc) else ""
        raise UnpatchedFailure(f"{qcase.name}: the unpatched model fails with base {base!r} "
                               f"({type(exc).__name__}: {first}): nothing of gradseam's to compare") from exc
    return check_strategy(qcase, config, atol=atol, whole=whole)
