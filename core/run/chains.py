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

Those checks make a follower compute again; they cannot take back what running ahead did to an
object the members were handed. So a head call holding a per-block state object (an argument the
family declares ``per_block``: a KV-cache layer the attention writes into) does not run ahead at
all: every member computes as its own region for that call.

A recompute reads such state again, as it is at backward time. So each region notes the tensors of
its state arguments (objects whose attributes hold tensors, dicts and lists of tensors) as its forward
left them, ids and versions only, and a recompute that finds one written in place or replaced since
raises, naming it: a cache refilled before backward would otherwise give wrong gradients, silently.
And what a recompute itself assigns to such an object (a cache layer appending its K/V again, a capture
slot filled again) is put back when it returns: the unpatched model ran the block once. The recompute
runs with the plain values (a mode, an index) such objects held when the forward began, so a cache
switched from "write" to "read" before backward recomputes the path the forward took.

The checks themselves live in :mod:`gradseam.run.links`. Any mismatch makes that member, and the rest
of the chain in this call, compute on their own:
exact either way. The next call tries the chunk again. Each cause warns once and is counted
(:attr:`Chain.stats`), so ``summary()`` says how many calls ran as chunks and why others did not.
"""

from __future__ import annotations

import threading
import weakref
from collections import Counter
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..errors import warn_once
from .links import (
    ORDER,
    PRE_HOOKS,
    RANDOM,
    SWAPPED,
    Link,
    rng_devices,
    rng_state,
    same_rng,
    set_rng_state,
    signature_of,
    snapshot,
)
from .seams import Original, SeamForward, recomputing
from .seams import latest as latest_seam

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

    ``scope`` (when set) is entered around each region call (:class:`gradseam.run.scopes.RegionScope`):
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
        flat = (*args, *kwargs.values())
        # The recompute runs long after the forward, with the same argument objects; a dict or list
        # the model edits in place between blocks (Flux 2 swaps each block's KV cache into one
        # kwargs dict) would hand the recompute another block's entries. So the recompute gets
        # fresh shallow copies of the containers as they were when the region ran forward.
        # Only containers are copied: holding a tensor argument here would keep it on the GPU until
        # backward, which is exactly what the unsloth backends free.
        # Under torch.compile the region is traced into a graph (no Python state may change inside it),
        # so it stays the plain call there.
        entry = None if torch.compiler.is_compiling() else tuple(
            _shallow(v) if isinstance(v, (dict, list)) else None for v in flat)

        frontier = latest_seam()  # a recompute passes through seams installed after this forward

        def region(*flat: Any) -> Any:
            with _RegionScope(), recomputing(frontier):
                return fn(*flat[:n], **dict(zip(names, flat[n:])))

        # State objects (a KV-cache layer) are read again by the recompute, where they are then: if something
        # rewrote them after this region's forward, the recompute would compute from other values and the
        # gradients would be wrong without a word. Their tensors as the forward left them are noted (ids and
        # versions only: holding them would keep memory) and checked before the recompute runs.
        watched = None if torch.compiler.is_compiling() else _watched(fn)
        # a chunk's head noted its members' swaps already (for its followers): read once per call
        swaps = getattr(fn, "swaps", None) or ([_swaps(m) for m in watched] if watched else None)
        holders = None if torch.compiler.is_compiling() else _state_holders(flat, names, n, entry)
        # What a recompute does to those objects is undone once it returns: the unpatched model ran the block
        # once, so a cache layer that appends its K/V in "write" mode (GLM-Image), or refills a slot the
        # caller emptied after the forward (SANA-WM's refiner), must not hold them twice or again.
        objects = None if torch.compiler.is_compiling() else _plain_objects(flat)
        # ... and a recompute runs with the plain values those objects held when the forward began (a cache's
        # mode, its sample index): switched between forward and backward ("write" to "read"), the recompute would
        # take another path than the forward did.
        scalars = _scalars(objects) if objects else None
        if (entry is not None and any(e is not None for e in entry)) or holders or objects or swaps and any(swaps):
            forward = region
            runs = [0]
            after: list[tuple[tuple[str, int, int], ...]] = []

            def region(*flat: Any) -> Any:  # the first call is the forward, later ones recompute
                runs[0] += 1
                if runs[0] > 1:
                    if swaps and any(swaps):
                        _check_swaps(watched, swaps)
                    if holders:
                        _check_state(holders, after[0], fn)
                    if entry is not None:
                        flat = tuple(_shallow(e) if e is not None else f for e, f in zip(entry, flat))
                    with _undone(objects):
                        if scalars:
                            _set_scalars(scalars)
                        return forward(*flat)
                out = forward(*flat)
                if holders:
                    after.append(_state_of(holders))
                return out

        if self.scope is None:
            return checkpoint(region, *flat, use_reentrant=False)
        with self.scope(args, kwargs) as context_fn:
            if context_fn is None:
                return checkpoint(region, *flat, use_reentrant=False)
            return checkpoint(region, *flat, use_reentrant=False, context_fn=context_fn)


def _state_holders(flat: tuple[Any, ...], names: tuple[str, ...], n: int,
                   entry: tuple[Any, ...] | None) -> list[tuple[str, Any]]:
    """The arguments that hold state the recompute reads again: plain Python objects whose attributes hold
    tensors (a KV-cache layer), and dicts or lists holding tensors (a layer cache as a dict, a mask in the
    attention kwargs), each as the recompute will see it (a container: the copy ``entry`` made at the call);
    with the argument's name for messages."""
    found = []
    for i, value in enumerate(flat):
        name = names[i - n] if i >= n else f"argument {i}"
        if isinstance(value, (dict, list)):
            held = entry[i] if entry is not None and entry[i] is not None else value
            if any(isinstance(v, torch.Tensor) for v in _values(held)):
                found.append((name, held))
            continue
        if value is None or isinstance(value, (torch.Tensor, nn.Module, tuple, str, int, float, bool)):
            continue
        attributes = getattr(value, "__dict__", None)
        if attributes and any(isinstance(v, torch.Tensor) for v in attributes.values()):
            found.append((name, value))
    return found


def _watched(fn: Call) -> list[nn.Module]:
    """The modules a region runs: a chunk's members, or the one module an :class:`Original` calls."""
    members = getattr(fn, "members", None)
    if members is not None:
        return list(members)
    module = getattr(fn, "module", None)
    return [module] if isinstance(module, nn.Module) else []


def _swaps(module: nn.Module) -> tuple[tuple[nn.Module, Any], ...]:
    """The forwards someone set on ``module`` or its direct submodules' instances (a model's loop that swaps an
    attention's forward around each block call, a hook registry's wrapper), gradseam's own seams left out:
    re-patching between a forward and its backward replaces those on purpose (the old graph's backward runs as
    the old patch would). Direct submodules only: a walk of every submodule per region would cost more."""
    found = []
    for m in (module, *module.children()):
        f = m.__dict__.get("forward")
        if f is not None and not isinstance(f, SeamForward):
            found.append((m, f))
    return tuple(found)


def _same_swaps(a: tuple[tuple[nn.Module, Any], ...], b: tuple[tuple[nn.Module, Any], ...]) -> bool:
    return len(a) == len(b) and all(m1 is m2 and f1 is f2 for (m1, f1), (m2, f2) in zip(a, b))


def _check_swaps(watched: list[nn.Module], before: list[tuple[tuple[nn.Module, Any], ...]]) -> None:
    for module, swaps in zip(watched, before):
        now = _swaps(module)
        if not _same_swaps(now, swaps):
            changed = {id(m) for m, _ in now} ^ {id(m) for m, _ in swaps} or {id(m) for m, _ in now}
            name = next((type(m).__name__ for m in (module, *module.children()) if id(m) in changed),
                        type(module).__name__)
            raise RuntimeError(
                f"gradseam: the forward of a {name} in this checkpointed {type(module).__name__} was replaced on the "
                "instance between the region's forward and its recompute in backward (a loop that swaps it around "
                "each call, as a flash-attention path may): the recompute would run other code than the forward "
                "did, and the gradients would be wrong. Keep the forward in place until backward (or do not swap it: "
                "HiDream-O1's use_flash_attn=False), or leave these blocks without checkpointing."
            )


_PLAIN = (torch.Tensor, nn.Module, tuple, str, int, float, bool, type, torch.dtype, torch.device)


def _plain_objects(flat: tuple[Any, ...]) -> list[Any]:
    """The arguments, and the values one level inside dict and list arguments, that are plain Python objects
    with attributes a block may assign to (a KV-cache layer, a cache of layers): what :class:`_undone` restores."""
    found: list[Any] = []
    for value in flat:
        inner = value.values() if isinstance(value, dict) else value if isinstance(value, list) else (value,)
        for v in inner:
            if v is not None and not isinstance(v, (*_PLAIN, dict, list)) and isinstance(getattr(v, "__dict__", None), dict) \
                    and not callable(v) and all(v is not f for f in found):
                found.append(v)
    return found


_SCALARS = (str, int, float, bool)


def _scalars(objects: list[Any]) -> list[tuple[Any, dict[str, Any]]]:
    """Each object's plain-value attributes (str, int, float, bool: a mode, an index, a flag), as they are now."""
    return [(obj, {k: v for k, v in vars(obj).items() if isinstance(v, _SCALARS)}) for obj in objects]


def _set_scalars(scalars: list[tuple[Any, dict[str, Any]]]) -> None:
    for obj, values in scalars:
        for k, v in values.items():
            if vars(obj).get(k, v) is not v:
                vars(obj)[k] = v


class _undone:
    """Puts back, when a recompute returns, the attributes of ``objects`` as they were when it began, and the
    contents of the lists and dicts they hold (one level: a cache's per-sample list of K/V tensors).

    Only for recomputes: the forward's own effects on the state are the model's and stay. Objects without a
    ``__dict__`` (slots) and deeper nesting are not covered; the state check above still refuses a recompute
    that would read state changed since the forward."""

    def __init__(self, objects: list[Any] | None) -> None:
        self.saved = [(obj, dict(vars(obj)), [(v, _shallow(v)) for v in vars(obj).values() if isinstance(v, (dict, list))])
                      for obj in objects or ()]

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        for obj, attributes, containers in self.saved:
            for container, contents in containers:
                if isinstance(container, list):
                    container[:] = contents
                else:
                    container.clear()
                    container.update(contents)
            vars(obj).clear()
            vars(obj).update(attributes)


def _named(fn: Call, holders: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """Positional state arguments named by ``fn``'s parameters where its signature says (for messages)."""
    import inspect

    target = getattr(fn, "function", fn)  # an Original: the block class's forward, whose first parameter is self
    try:
        params = [p.name for p in inspect.signature(target).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][1 if target is not fn else 0:]
    except (TypeError, ValueError):
        return holders
    named = []
    for name, holder in holders:
        if name.startswith("argument "):
            i = int(name.removeprefix("argument "))
            name = params[i] if i < len(params) else name
        named.append((name, holder))
    return named


def _values(holder: Any) -> list[tuple[str, Any]] | Any:
    if isinstance(holder, dict):
        return holder.values()
    if isinstance(holder, list):
        return holder
    return vars(holder).values()


def _items(holder: Any) -> Any:
    if isinstance(holder, dict):
        return ((f"[{k!r}]", v) for k, v in holder.items())
    if isinstance(holder, list):
        return ((f"[{i}]", v) for i, v in enumerate(holder))
    return ((f".{k}", v) for k, v in vars(holder).items())


def _state_of(holders: list[tuple[str, Any]]) -> tuple[tuple[str, Any, int], ...]:
    # weak references, not ids: a replaced tensor freed meanwhile could leave its id to the new one
    return tuple((f"{name}{where}", weakref.ref(v), v._version) for name, obj in holders
                 for where, v in _items(obj) if isinstance(v, torch.Tensor))


def _check_state(holders: list[tuple[str, Any]], before: tuple[tuple[str, Any, int], ...], fn: Call) -> None:
    now = {what: ref() for what, ref, _ in _state_of(holders)}
    for what, ref, version in before:
        tensor = now.get(what)
        if tensor is None or tensor is not ref() or tensor._version != version:
            how = "written in place" if tensor is not None and tensor is ref() else "replaced"
            # a positional argument named by the block's signature, looked up only here (off the hot path)
            for (plain, _), (named, _) in zip(holders, _named(fn, holders)):
                if what.startswith(plain) and what[len(plain):len(plain) + 1] in (".", "["):
                    what = named + what[len(plain):]
                    break
            raise RuntimeError(
                f"gradseam: {what} was {how} after this checkpointed region's forward and before its recompute in "
                "backward (a KV cache rewritten for the next chunk, say): the recompute would read the new values and "
                "the gradients would be wrong. Run backward before the state is rewritten, or leave these blocks "
                "without checkpointing (gradient_checkpointing_blocks with gradient_checkpointing: false)."
            )


def _shallow(value: Any) -> Any:
    if isinstance(value, dict):
        return dict(value)
    if isinstance(value, list):
        return list(value)
    return value


@dataclass
class ChainStats:
    """How a chain's calls went, for ``summary()`` and the handle's region view."""

    member_calls: list[int]  # calls with gradients enabled, per member
    runs: int = 0  # checkpoint regions computed (a whole chain counts once)
    chunk_calls: int = 0  # head calls that ran the whole chain
    served: int = 0  # follower calls answered from the chain's kept outputs
    fallbacks: Counter[str] = field(default_factory=Counter)  # cause -> calls that computed alone
    notes: Counter[str] = field(default_factory=Counter)  # how calls ran as planned, where it is worth telling


class _Flight:
    """What one chunk call keeps for its followers, from the head's return to the last follower."""

    __slots__ = ("devices", "head", "kept", "next", "rng", "swaps", "versions")

    def __init__(self, head: dict[str, Any], kept: list[Any], versions: list[tuple[int, ...]],
                 rng: list[tuple[torch.Tensor, ...]] | None, devices: tuple[torch.device, ...],
                 swaps: list[tuple[tuple[nn.Module, Any], ...]] | None = None) -> None:
        self.head, self.kept, self.versions, self.rng, self.devices = head, kept, versions, rng, devices
        self.swaps = swaps  # each member's instance forwards at the head's call, when it ran ahead
        self.next = 1


class Chain:
    """A checkpoint region spanning one or more modules; see the module docstring."""

    def __init__(self, members: Sequence[nn.Module], link: Link | None, runner: Runner, label: str,
                 stats: ChainStats | None = None) -> None:
        if len(members) > 1 and link is None:
            raise ValueError("a chain of several modules needs a link")
        self.members = list(members)
        self.link = link
        self.runner = runner
        self.label = label
        self.stats = stats if stats is not None else ChainStats([0] * len(self.members))
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

    def _fall_back(self, cause: str, *, ran_ahead: bool = True) -> None:
        self._flight = None
        self.stats.fallbacks[cause] += 1
        cost = ("each fallback recomputes the chunk's later blocks once more" if ran_ahead else
                "such a call costs what interval 1 does: one region, and its kept inputs, per block")
        warn_once(
            f"gradseam: a checkpoint chunk of {type(self.members[0]).__name__} blocks fell back to one region "
            f"per block for this call because {cause}. Results stay exact; the chunk is tried again on the "
            f"next call, and summary() counts how often this happens ({cost})."
        )

    def _run_head(self, original: Original, args: tuple, kwargs: dict) -> Any:
        self._flight = None
        if len(self.members) == 1:
            return self._alone(original, args, kwargs)
        if any(m._forward_pre_hooks for m in self.members[1:]):
            # Running a member ahead skips its pre-hooks, and they may be what makes it runnable:
            # FSDP2's fully_shard gathers the block's weights in one. Exact beats chunked; checked
            # on every call (not latched), so the chunk comes back once the hooks are removed.
            self._fall_back(PRE_HOOKS, ran_ahead=False)
            return self._alone(original, args, kwargs)
        link = self.link
        assert link is not None
        head = signature_of(type(self.members[0])).bind(self.members[0], args, kwargs)
        stateful = link.holds_state(self.members[0], head)
        if stateful is not None:
            # A later member run ahead would get the head's own state object (its KV-cache layer)
            # and write into it; the follower checks would make outputs exact again, but not the
            # cache. Checked per call: the same model trains chunked when it is called without one.
            self._fall_back(stateful, ran_ahead=False)
            return self._alone(original, args, kwargs)
        originals = self._originals
        compiling = torch.compiler.is_compiling()
        devices = () if compiling else rng_devices(args, kwargs)
        states: list[tuple[torch.Tensor, ...]] = []
        first_pass = [True]  # the recompute in backward runs the chain again: record the forward only

        def whole_chain(*a: Any, **k: Any) -> tuple[Any, ...]:
            record = first_pass[0] and not compiling
            first_pass[0] = False
            # in the recompute a and k hold the forward-time copies of containers (see Runner)
            called = head if record or compiling else signature_of(type(self.members[0])).bind(self.members[0], a, k)
            outs = [originals[0](*a, **k)]  # type: ignore[misc]
            if record:
                states.append(rng_state(devices))
            for j in range(1, len(self.members)):
                ca, ck = link.next_call(self.members[j], outs[-1], called)
                outs.append(originals[j](*ca, **ck))  # type: ignore[misc]
                if record:
                    states.append(rng_state(devices))
            return tuple(outs)

        swaps = None if compiling else [_swaps(m) for m in self.members]
        whole_chain.members = self.members  # type: ignore[attr-defined]  # what the recompute check watches,
        whole_chain.swaps = swaps  # type: ignore[attr-defined]  # and how their instances stood at this call
        self.stats.runs += 1
        self.stats.chunk_calls += 1
        outs = list(self.runner(whole_chain, args, kwargs))
        versions = [tuple(t._version for t in link.carried(out)) for out in outs]
        if not compiling:
            set_rng_state(states[0], devices)  # as if only the head had run: the loop may draw next
        self._flight = _Flight({k: snapshot(v) for k, v in head.items()}, outs, versions,
                               None if compiling else states, devices, swaps)
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
        if cause is None and flight.rng is not None and not same_rng(rng_state(flight.devices), flight.rng[index - 1]):
            cause = RANDOM
        if cause is None and flight.swaps is not None and not _same_swaps(_swaps(self.members[index]),
                                                                           flight.swaps[index]):
            cause = SWAPPED  # it ran ahead with the forward its instance had at the head's call
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
