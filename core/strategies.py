"""Checkpoint regions: one block, a chunk of blocks, or a feed-forward seam inside a block.

Every region is a *chain*: modules that the model calls one after another, each on the previous
one's output. A chain of one is a plain checkpointed call. For longer chains (interval chunks,
or an FFN made of two submodules) the first member runs the whole chain inside one checkpoint
and keeps the later members' outputs; each later member, when called exactly as the chain
called it, hands back the kept output instead of computing. The model's own loop is never copied
or edited, so everything the loop (or a hook) does between two members has to be *noticed*:

* the carried value must be the very object the predecessor returned, unchanged since (its
  version counter: a forward hook or a ControlNet residual added in place bumps it);
* every other argument must be the head's, unchanged (identity and version for tensors,
  equality for plain values, compared against a snapshot so a dict edited in place shows);
* no random numbers may have been drawn in between. The chain ran its later members ahead, so
  after the head returns the generators are put back to where the head alone would have left
  them; a follower then finds them exactly there unless the loop drew (stochastic depth), and
  each follower served from the chain moves them on to where its own run left them.

Any mismatch makes that member, and the rest of the chain in this call, compute on their own:
exact either way. The next call tries the chunk again. Each cause warns once and is counted
(:attr:`Chain.stats`), so ``summary()`` says how many calls ran as chunks and why others did not.
"""

from __future__ import annotations

import inspect
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .errors import UnsupportedModelError
from .family import Carry
from .planning import _warn_once
from .seams import Original

Call = Callable[..., Any]

_state = threading.local()


def inside_region() -> bool:
    """True while a checkpoint region (forward or its recompute) is running on this thread.

    Attention offload consults it: inside a recomputed region nothing is kept for long, so
    moving those tensors to the CPU would cost copies and save nothing.
    """
    return getattr(_state, "depth", 0) > 0


class _RegionScope:
    # Under torch.compile the scope is a no-op: dynamo cannot trace the thread-local, and the only
    # reader (attention offload) runs eagerly anyway, outside any compiled region.
    def __enter__(self) -> None:
        if not torch.compiler.is_compiling():
            _state.depth = getattr(_state, "depth", 0) + 1

    def __exit__(self, *exc: object) -> None:
        if not torch.compiler.is_compiling():
            _state.depth -= 1


class Runner:
    """Runs a callable as one non-reentrant checkpoint region.

    ``scope`` (when set) is entered around each region call (:class:`gradseam.scopes.RegionScope`):
    it may open saved-tensor hooks, which around a non-reentrant checkpoint see only what the
    checkpoint keeps across the region (its inputs: what the unsloth backends move to the CPU), and
    it yields the checkpoint's ``context_fn`` (attention kernels kept instead of recomputed) or None.
    """

    def __init__(self, scope: Callable[[tuple, dict], AbstractContextManager[Any]] | None = None) -> None:
        self.scope = scope

    def __call__(self, fn: Call, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        # Keyword arguments go in positionally: checkpoint keeps positional tensors through
        # save_for_backward (visible to saved-tensor hooks, so they can be offloaded) but keyword
        # arguments only in a closure, out of any hook's reach.
        names = tuple(kwargs)
        n = len(args)

        def region(*flat: Any) -> Any:
            with _RegionScope():
                return fn(*flat[:n], **dict(zip(names, flat[n:])))

        flat = (*args, *kwargs.values())
        if self.scope is None:
            return checkpoint(region, *flat, use_reentrant=False)
        with self.scope(args, kwargs) as context_fn:
            if context_fn is None:
                return checkpoint(region, *flat, use_reentrant=False)
            return checkpoint(region, *flat, use_reentrant=False, context_fn=context_fn)


# -- signatures, snapshots and generator states ------------------------------------------------


@dataclass(frozen=True)
class Signature:
    """A block class's ``forward`` signature, read once per class (not once per call)."""

    signature: inspect.Signature
    receiver: str  # the first parameter, whatever the class calls it ("self" by convention only)
    var_keyword: str | None  # the name of ``**kwargs``, if the forward has one

    def bind(self, module: nn.Module, args: tuple, kwargs: dict) -> dict[str, Any]:
        """Every parameter by name (defaults applied), the receiver left out."""
        bound = self.signature.bind(module, *args, **kwargs)
        bound.apply_defaults()
        arguments = dict(bound.arguments)
        del arguments[self.receiver]
        return arguments

    def spread(self, arguments: dict[str, Any]) -> dict[str, Any]:
        """Keyword arguments for a call, with a ``**kwargs`` bag spread back out."""
        flat = {k: v for k, v in arguments.items() if k != self.var_keyword}
        if self.var_keyword is not None:
            flat.update(arguments.get(self.var_keyword) or {})
        return flat


_signatures: dict[type, Signature] = {}


def signature_of(cls: type) -> Signature:
    found = _signatures.get(cls)
    if found is None:
        sig = inspect.signature(cls.forward)
        params = list(sig.parameters.values())
        if not params or params[0].kind not in (params[0].POSITIONAL_ONLY, params[0].POSITIONAL_OR_KEYWORD):
            raise UnsupportedModelError(f"{cls.__qualname__}.forward takes no receiver parameter; cannot chain it.")
        var_kw = next((p.name for p in params if p.kind is p.VAR_KEYWORD), None)
        found = _signatures[cls] = Signature(sig, params[0].name, var_kw)
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


def _rng_devices(args: tuple, kwargs: dict) -> tuple[torch.device, ...]:
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


def _same_rng(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> bool:
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


IDENTITY = "the carried output was replaced between blocks"
VERSION = "the carried output was changed in place between blocks (a forward hook or a residual added in place)"
ARGUMENTS = "another argument differs from the first block's (or was changed in place)"
RANDOM = "random numbers were drawn between blocks"
ORDER = "the blocks were called out of order"
PRE_HOOKS = "the blocks carry forward pre-hooks (FSDP2's fully_shard gathers a block's weights in one)"


class BlockLink(Link):
    """Blocks of one list: carried outputs go to named parameters, everything else is unchanged."""

    def __init__(self, carry: Carry, where: str = "") -> None:
        self.carry = carry
        self.where = where  # "family 'wan', transformer.blocks": for errors about the declaration

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
        sig = signature_of(type(member))
        return (), sig.spread({**head, **self._carried(prev_out)})

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
        if tuple(t._version for t in self.carried(prev_out)) != versions:
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


@dataclass
class ChainStats:
    """How a chain's calls went, for ``summary()`` and the handle's region view."""

    member_calls: list[int]  # calls with gradients enabled, per member
    runs: int = 0  # checkpoint regions computed (a whole chain counts once)
    chunk_calls: int = 0  # head calls that ran the whole chain
    served: int = 0  # follower calls answered from the chain's kept outputs
    fallbacks: Counter[str] = field(default_factory=Counter)  # cause -> calls that computed alone


class _Flight:
    """What one chunk call keeps for its followers, from the head's return to the last follower."""

    __slots__ = ("devices", "head", "kept", "next", "rng", "versions")

    def __init__(self, head: dict[str, Any], kept: list[Any], versions: list[tuple[int, ...]],
                 rng: list[tuple[torch.Tensor, ...]] | None, devices: tuple[torch.device, ...]) -> None:
        self.head, self.kept, self.versions, self.rng, self.devices = head, kept, versions, rng, devices
        self.next = 1


class Chain:
    """A checkpoint region spanning one or more modules; see the module docstring."""

    def __init__(self, members: Sequence[nn.Module], link: Link | None, runner: Runner, label: str) -> None:
        if len(members) > 1 and link is None:
            raise ValueError("a chain of several modules needs a link")
        self.members = list(members)
        self.link = link
        self.runner = runner
        self.label = label
        self.stats = ChainStats([0] * len(self.members))
        self._originals: list[Original | None] = [None] * len(members)
        self._flight: _Flight | None = None

    def reset(self) -> None:
        """Drop the outputs kept for later members (the patcher calls this around every model forward)."""
        self._flight = None

    def __getstate__(self) -> dict[str, Any]:
        # A copy (deepcopy, pickle) starts with nothing in flight: kept outputs are graph tensors
        # of a step that belongs to the original and cannot be deep-copied anyway.
        return {**self.__dict__, "_flight": None}

    def handler(self, index: int) -> Callable[[Original, tuple, dict], Any]:
        return _MemberHandler(self, index)

    def attach(self, index: int, original: Original) -> None:
        """Tell the chain how to call member ``index`` without going through its wrapper."""
        self._originals[index] = original

    def run_member(self, index: int, original: Original, args: tuple, kwargs: dict) -> Any:
        if not torch.is_grad_enabled():
            return original(*args, **kwargs)  # inference: add no work
        self.stats.member_calls[index] += 1
        if index == 0:
            return self._run_head(original, args, kwargs)
        return self._run_follower(index, original, args, kwargs)

    def _alone(self, original: Original, args: tuple, kwargs: dict) -> Any:
        self.stats.runs += 1
        return self.runner(original, args, kwargs)

    def _fall_back(self, cause: str) -> None:
        self._flight = None
        self.stats.fallbacks[cause] += 1
        _warn_once(
            f"gradseam: a checkpoint chunk of {type(self.members[0]).__name__} blocks fell back to one region "
            f"per block for this call because {cause}. Results stay exact; the chunk is tried again on the "
            "next call, and summary() counts how often this happens (each fallback recomputes the chunk's "
            "later blocks once more)."
        )

    def _run_head(self, original: Original, args: tuple, kwargs: dict) -> Any:
        self._flight = None
        if len(self.members) == 1:
            return self._alone(original, args, kwargs)
        if any(m._forward_pre_hooks for m in self.members[1:]):
            # Running a member ahead skips its pre-hooks, and they may be what makes it runnable:
            # FSDP2's fully_shard gathers the block's weights in one. Exact beats chunked; checked
            # on every call (not latched), so the chunk comes back once the hooks are removed.
            self._fall_back(PRE_HOOKS)
            return self._alone(original, args, kwargs)
        link = self.link
        assert link is not None
        head = signature_of(type(self.members[0])).bind(self.members[0], args, kwargs)
        originals = self._originals
        compiling = torch.compiler.is_compiling()
        devices = () if compiling else _rng_devices(args, kwargs)
        states: list[tuple[torch.Tensor, ...]] = []
        first_pass = [True]  # the recompute in backward runs the chain again: record the forward only

        def whole_chain(*a: Any, **k: Any) -> tuple[Any, ...]:
            record = first_pass[0] and not compiling
            first_pass[0] = False
            outs = [originals[0](*a, **k)]  # type: ignore[misc]
            if record:
                states.append(rng_state(devices))
            for j in range(1, len(self.members)):
                ca, ck = link.next_call(self.members[j], outs[-1], head)
                outs.append(originals[j](*ca, **ck))  # type: ignore[misc]
                if record:
                    states.append(rng_state(devices))
            return tuple(outs)

        self.stats.runs += 1
        self.stats.chunk_calls += 1
        outs = list(self.runner(whole_chain, args, kwargs))
        versions = [tuple(t._version for t in link.carried(out)) for out in outs]
        if not compiling:
            set_rng_state(states[0], devices)  # as if only the head had run: the loop may draw next
        self._flight = _Flight({k: snapshot(v) for k, v in head.items()}, outs, versions,
                               None if compiling else states, devices)
        return outs[0]

    def _run_follower(self, index: int, original: Original, args: tuple, kwargs: dict) -> Any:
        flight = self._flight
        if flight is None:
            return self._alone(original, args, kwargs)  # the head ran alone, or this call fell back
        if flight.next != index:
            self._fall_back(ORDER)
            return self._alone(original, args, kwargs)
        assert self.link is not None
        cause = self.link.mismatch(self.members[index], flight.kept[index - 1], flight.versions[index - 1],
                                   flight.head, args, kwargs)
        if cause is None and flight.rng is not None and not _same_rng(rng_state(flight.devices), flight.rng[index - 1]):
            cause = RANDOM
        if cause is not None:
            self._fall_back(cause)
            return self._alone(original, args, kwargs)
        out = flight.kept[index]
        if flight.rng is not None:
            set_rng_state(flight.rng[index], flight.devices)  # where this member's own run left them
        self.stats.served += 1
        if index == len(self.members) - 1:
            self._flight = None  # drop references to the chunk's outputs as soon as possible
        else:
            flight.next = index + 1
        return out


class _MemberHandler:
    __slots__ = ("chain", "index")

    def __init__(self, chain: Chain, index: int) -> None:
        self.chain = chain
        self.index = index

    def __call__(self, original: Original, args: tuple, kwargs: dict) -> Any:
        return self.chain.run_member(self.index, original, args, kwargs)
