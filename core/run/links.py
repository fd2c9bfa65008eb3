"""How a chain member is called from its predecessor's output, and how a change is noticed.

An interval chunk runs its later blocks ahead of the model's loop, so everything the loop (or a
hook) does between two blocks must be noticed before a later block is served from the chunk: the
carried value replaced or edited in place, another argument, random numbers drawn in between.
This module holds those checks (:class:`Link` and its two kinds) and what they compare with:
signatures read once per class, snapshots of arguments that a later in-place edit cannot change,
and the generators' states. :mod:`gradseam.run.chains` runs the chains.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import UnsupportedModelError
from ..family import Carry


@dataclass(frozen=True)
class Signature:
    """A block class's ``forward`` signature, read once per class (not once per call)."""

    signature: inspect.Signature
    receiver: str  # the first parameter, whatever the class calls it ("self" by convention only)
    var_keyword: str | None  # the name of ``**kwargs``, if the forward has one
    positional: tuple[str, ...] = ()  # parameters that must go in by position: up to ``*args``, or positional-only
    var_positional: str | None = None  # the name of ``*args``, if the forward has one

    def bind(self, module: nn.Module, args: tuple, kwargs: dict) -> dict[str, Any]:
        """Every parameter by name (defaults applied), the receiver left out."""
        bound = self.signature.bind(module, *args, **kwargs)
        bound.apply_defaults()
        arguments = dict(bound.arguments)
        del arguments[self.receiver]
        return arguments

    def spread(self, arguments: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Positional and keyword arguments for a call of what :meth:`bind` read.

        ``*args`` and ``**kwargs`` bags are spread back out; what stands before a ``*args`` (and any
        positional-only parameter) goes in by position, as a keyword could not reach it.
        """
        args = tuple(arguments[name] for name in self.positional)
        if self.var_positional is not None:
            args += tuple(arguments.get(self.var_positional) or ())
        skip = {*self.positional, self.var_positional, self.var_keyword}
        flat = {k: v for k, v in arguments.items() if k not in skip}
        if self.var_keyword is not None:
            flat.update(arguments.get(self.var_keyword) or {})
        return args, flat


_signatures: dict[type, Signature] = {}


def signature_of(cls: type) -> Signature:
    found = _signatures.get(cls)
    if found is None:
        sig = inspect.signature(cls.forward)
        params = list(sig.parameters.values())
        if not params or params[0].kind not in (params[0].POSITIONAL_ONLY, params[0].POSITIONAL_OR_KEYWORD):
            raise UnsupportedModelError(f"{cls.__qualname__}.forward takes no receiver parameter; cannot chain it.")
        var_kw = next((p.name for p in params if p.kind is p.VAR_KEYWORD), None)
        var_pos = next((p.name for p in params if p.kind is p.VAR_POSITIONAL), None)
        rest = params[1:]
        if var_pos is not None:  # everything before *args has to be positional for *args to be reached
            positional = tuple(p.name for p in rest[:[p.name for p in rest].index(var_pos)])
        else:
            positional = tuple(p.name for p in rest if p.kind is p.POSITIONAL_ONLY)
        found = _signatures[cls] = Signature(sig, params[0].name, var_kw, positional, var_pos)
    return found


class _Tensor:
    """A tensor argument as it was: the object and its version counter."""

    __slots__ = ("tensor", "version")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor, self.version = tensor, tensor._version

    def matches(self, value: Any) -> bool:
        return value is self.tensor and value._version == self.version


class _Items:
    """A tuple, list or dict argument as it was: its type and its items' snapshots."""

    __slots__ = ("items", "kind")

    def __init__(self, kind: type, items: tuple[Any, ...]) -> None:
        self.kind, self.items = kind, items


def snapshot(value: Any) -> Any:
    """What an argument is now, in a form that a later in-place edit cannot change."""
    if isinstance(value, torch.Tensor):
        return _Tensor(value)
    if isinstance(value, (tuple, list)):
        return _Items(type(value), tuple(snapshot(v) for v in value))
    if isinstance(value, dict):
        return _Items(dict, tuple((k, snapshot(v)) for k, v in value.items()))
    return value


def unchanged(snap: Any, value: Any) -> bool:
    """Whether ``value`` is still what :func:`snapshot` recorded."""
    if isinstance(snap, _Tensor):
        return snap.matches(value)
    if isinstance(snap, _Items):
        if type(value) is not snap.kind or len(value) != len(snap.items):
            return False
        if snap.kind is dict:
            return all(k in value and unchanged(s, value[k]) for k, s in snap.items)
        return all(unchanged(s, v) for s, v in zip(snap.items, value))
    if isinstance(value, (torch.Tensor, tuple, list, dict)):
        return False
    if snap is value:
        return True
    try:
        return type(snap) is type(value) and bool(snap == value)
    except Exception:
        return False


def rng_devices(args: tuple, kwargs: dict) -> tuple[torch.device, ...]:
    found: list[torch.device] = []
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor) and value.device.type == "cuda" and value.device not in found:
            found.append(value.device)
    return tuple(found)


def rng_state(devices: tuple[torch.device, ...]) -> tuple[torch.Tensor, ...]:
    """The generators a block's dropout draws from: the CPU's and each CUDA device's the inputs live on."""
    return (torch.get_rng_state(), *(torch.cuda.get_rng_state(d) for d in devices))


def set_rng_state(state: tuple[torch.Tensor, ...], devices: tuple[torch.device, ...]) -> None:
    torch.set_rng_state(state[0])
    for d, s in zip(devices, state[1:]):
        torch.cuda.set_rng_state(s, d)


def same_rng(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


# -- how a chain member is called from its predecessor's output ------------------------------


class Link:
    """How member ``j+1`` of a chain is called, given member ``j``'s output and the head's arguments."""

    def next_call(self, member: nn.Module, prev_out: Any, head: dict[str, Any]) -> tuple[tuple, dict]:
        raise NotImplementedError

    def mismatch(self, member: nn.Module, prev_out: Any, versions: tuple[int, ...], head: dict[str, Any],
                 args: tuple, kwargs: dict) -> str | None:
        """Why a follower's actual call differs from the chain's, or None if it does not."""
        raise NotImplementedError

    def carried(self, prev_out: Any) -> tuple[torch.Tensor, ...]:
        """The tensors handed from one member to the next (their versions are checked)."""
        raise NotImplementedError

    def holds_state(self, member: nn.Module, head: dict[str, Any]) -> str | None:
        """Why the chain must not run ahead from this head call at all, or None.

        The follower checks catch what the loop changes *after* the head ran, and make the member
        compute again; they cannot undo what running ahead already did to an object the head was
        handed. So a head call holding a per-block state object is refused before anything runs.
        """
        return None


IDENTITY = "the carried output was replaced between blocks"
VERSION = "the carried output was changed in place between blocks (a forward hook or a residual added in place)"
ARGUMENTS = "another argument differs from the first block's (or was changed in place)"
RANDOM = "random numbers were drawn between blocks"
ORDER = "the blocks were called out of order"
PRE_HOOKS = "the blocks carry forward pre-hooks (FSDP2's fully_shard gathers a block's weights in one)"
SWAPPED = ("a block's (or one of its submodules') forward was replaced on the instance between the chunk's first block "
           "and this one (a loop that swaps it around each call)")
PER_BLOCK = (
    "the first block was handed its own state object (an argument the family declares per_block, such as a "
    "KV-cache layer), which running the later blocks ahead would hand to them too"
)


class BlockLink(Link):
    """Blocks of one list: carried outputs go to named parameters, everything else is unchanged."""

    def __init__(self, carry: Carry, where: str = "", per_block: tuple[str, ...] = ()) -> None:
        self.carry = carry
        self.where = where  # "family 'wan', transformer.blocks": for errors about the declaration
        self.per_block = tuple(name.split(".") for name in per_block)

    def holds_state(self, member: nn.Module, head: dict[str, Any]) -> str | None:
        if not self.per_block:
            return None
        bag = signature_of(type(member)).var_keyword
        extra = (head.get(bag) or {}) if bag is not None else {}  # a name the forward does not list lands here
        for first, *keys in self.per_block:
            value = head[first] if first in head else extra.get(first)
            for key in keys:
                if value is None:
                    break
                value = value.get(key) if isinstance(value, Mapping) else getattr(value, key, None)
            if value is not None:
                return PER_BLOCK
        return None

    def _carried(self, prev_out: Any) -> dict[str, Any]:
        out: dict[str, Any] = {}
        sequence = isinstance(prev_out, (tuple, list))
        for name, pos in self.carry.outputs.items():
            # A position into a single tensor would index its first dimension: no error, wrong values.
            if (pos is None) == sequence or (pos is not None and pos >= len(prev_out)):
                what = f"a {type(prev_out).__name__} of {len(prev_out)}" if sequence else f"a single {type(prev_out).__name__}"
                where = "the whole output" if pos is None else f"output position {pos}"
                raise UnsupportedModelError(
                    f"{self.where}: the family's Carry maps {name!r} to {where}, but the block returned "
                    f"{what}; fix the Carry in the adapter (see 'Carry' in docs/plugins.md)."
                )
            out[name] = prev_out if pos is None else prev_out[pos]
        return out

    def carried(self, prev_out: Any) -> tuple[torch.Tensor, ...]:
        return tuple(v for v in self._carried(prev_out).values() if isinstance(v, torch.Tensor))

    def next_call(self, member: nn.Module, prev_out: Any, head: dict[str, Any]) -> tuple[tuple, dict]:
        return signature_of(type(member)).spread({**head, **self._carried(prev_out)})

    def mismatch(self, member: nn.Module, prev_out: Any, versions: tuple[int, ...], head: dict[str, Any],
                 args: tuple, kwargs: dict) -> str | None:
        try:
            bound = signature_of(type(member)).bind(member, args, kwargs)
        except TypeError:
            return ARGUMENTS
        carried = self._carried(prev_out)
        for name, value in carried.items():
            if bound.get(name) is not value:
                return IDENTITY
        if tuple(v._version for v in carried.values() if isinstance(v, torch.Tensor)) != versions:
            return VERSION
        for name, value in bound.items():
            if name not in carried and not unchanged(head.get(name), value):
                return ARGUMENTS
        return None


class SeamLink(Link):
    """Submodules of an FFN seam: each takes the previous one's output as its only argument."""

    def next_call(self, member: nn.Module, prev_out: Any, head: dict[str, Any]) -> tuple[tuple, dict]:
        return (prev_out,), {}

    def carried(self, prev_out: Any) -> tuple[torch.Tensor, ...]:
        return (prev_out,) if isinstance(prev_out, torch.Tensor) else ()

    def mismatch(self, member: nn.Module, prev_out: Any, versions: tuple[int, ...], head: dict[str, Any],
                 args: tuple, kwargs: dict) -> str | None:
        if len(args) != 1 or kwargs:
            return ARGUMENTS
        if args[0] is not prev_out:
            return IDENTITY
        if tuple(t._version for t in self.carried(prev_out)) != versions:
            return VERSION
        return None
