"""A case's model, built once and copied after: what :meth:`Case.fresh` hands out.

Every check builds its case's model afresh (``torch.manual_seed(seed)`` then ``build()``), often twice (the
model it patches and the reference it compares with), and a suite runs 10-20 checks per case. Building a
diffusers model is mostly Python (config registration, module constructors, weight initialisation): it took a
quarter of the kit's time on the CPU, more than the steps it compared. A deep copy of the model as it was built
is the same model for a fraction of that.

A copy must never differ from what ``build()`` would give now, so :func:`fresh` hands one out only when:

* the key matches: the same ``build`` callable (held, so its id is not reused), seed and default dtype, and the
  same data the build reads: the values its closure holds and the globals its code names, followed into the
  functions those are (two levels), plain data by value (a width in a dict a test changed gives another key),
  anything else by identity;
* a second real build gave the same digest (:func:`~gradseam.testing.digests.model_digest`) as the first: a
  build that is not deterministic under its seed is never copied, and the reference's own check still names it;
* the model is plain: every parameter and buffer a CPU tensor of torch's own types (a quantized weight's
  subclass, or a model on the GPU, whose build may draw from the device's generator, is built every time) and no
  module holds hooks (a hook closed over the built module would still point at the template).

After a copy, the CPU generator is where ``build()`` would have left it, so whatever a check draws next is
unchanged. The cache holds :data:`MAX_BUILT` templates, least recently used first out: a few tiny models.
"""

from __future__ import annotations

import copy
import functools
import types
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .digests import Same, model_digest

MAX_BUILT = 8
_PLAIN = (torch.Tensor, nn.Parameter)


@dataclass
class _Template:
    model: nn.Module  # never run, never handed out: only copied
    rng: torch.Tensor  # the CPU generator's state right after build()
    digest: str
    verified: bool = False  # a second build digested the same


_BUILT: OrderedDict[tuple[Any, ...], _Template | None] = OrderedDict()  # None: built every time
_COUNTS = {"built": 0, "copied": 0}


def fresh(build: Callable[[], nn.Module], seed: int) -> nn.Module:
    """``build()`` right after ``torch.manual_seed(seed)``, or a copy of the model it gave before (see above)."""
    torch.manual_seed(seed)
    key = (build, seed, torch.get_default_dtype(), _reads(build))
    known = key in _BUILT
    template = _BUILT.get(key)
    if known:
        _BUILT.move_to_end(key)
    if template is not None and template.verified:
        _COUNTS["copied"] += 1
        model = copy.deepcopy(template.model)
        torch.set_rng_state(template.rng)
        return model
    model = build()
    _COUNTS["built"] += 1
    if known and template is None:
        return model
    if template is not None:  # the second build: copies from now on only if it is the same model
        if model_digest(model) == template.digest:
            template.verified = True
        else:
            _BUILT[key] = None
        return model
    _BUILT[key] = _template(model)
    while len(_BUILT) > MAX_BUILT:
        _BUILT.popitem(last=False)
    return model


def _reads(fn: Any, depth: int = 0) -> tuple[Any, ...]:
    """What ``fn`` reads besides its arguments: closure values and named globals, plain data by value, other
    objects by identity (held, so an id is never reused), Python functions among them followed ``2 - depth`` more
    levels."""
    if isinstance(fn, functools.partial):
        return (_value(fn.func, depth), *(_value(a, depth) for a in fn.args),
                *(_value(v, depth) for v in fn.keywords.values()))
    code = getattr(fn, "__code__", None)
    if code is None:
        return (Same(fn),)
    values: list[Any] = [_value(cell.cell_contents, depth) for cell in getattr(fn, "__closure__", None) or ()
                         if _filled(cell)]
    glob = getattr(fn, "__globals__", {})
    values += [(name, _value(glob[name], depth)) for name in _names(code) if name in glob]
    return tuple(values)


def _names(code: types.CodeType) -> list[str]:
    names = list(code.co_names)
    for const in code.co_consts:  # a lambda or nested function defined inside reads through the same globals
        if isinstance(const, types.CodeType):
            names += _names(const)
    return names


def _filled(cell: Any) -> bool:
    try:
        return cell.cell_contents is not _filled  # (always true: reading it is the test)
    except ValueError:  # not assigned yet
        return False


def _value(value: Any, depth: int) -> Any:
    if value is None or isinstance(value, (bool, int, float, str, bytes, torch.dtype, torch.device)):
        return value
    if isinstance(value, (dict, list, tuple, set, frozenset)):
        try:
            return repr(value)  # by value: a test that changes the dict a build reads changes the key
        except Exception:
            return Same(value)
    if isinstance(value, (types.FunctionType, functools.partial)) and depth < 2:
        return (Same(value), _reads(value, depth + 1))
    return Same(value)


def _template(model: nn.Module) -> _Template | None:
    rng = torch.get_rng_state()
    if not _plain(model):
        return None
    try:
        kept = copy.deepcopy(model)
    except Exception:  # an attribute that cannot be copied: build every time
        return None
    return _Template(kept, rng, model_digest(model))


def _plain(model: nn.Module) -> bool:
    tensors = [*model.parameters(), *model.buffers()]
    if not all(type(t) in _PLAIN and t.device.type == "cpu" for t in tensors):
        return False
    hooks = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
             "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
             "_load_state_dict_post_hooks")
    return not any(getattr(m, name, None) for m in model.modules() for name in hooks) and not any(
        getattr(m, "parametrizations", None) for m in model.modules())


def forget() -> None:
    """Drop every template (the next :func:`fresh` of each case builds again, twice before copying)."""
    _BUILT.clear()


def info() -> dict[str, int]:
    """Models built and copied since the process started, and templates held (for tests of the cache)."""
    return {**_COUNTS, "templates": sum(t is not None for t in _BUILT.values())}
