"""Attention kernels as ops: keep their outputs across a checkpoint instead of recomputing them.

A whole-block checkpoint recomputes everything in backward, attention included, and at long
sequences attention is most of the block's forward. But what attention's backward needs from its
forward is small beside the block's other activations: the kernel's output and its softmax
statistics. Keeping exactly those, and recomputing every other op, gives whole-block memory at
close to no-recompute speed (measured numbers: docs/benchmarks.md).

Attention is matched by *operator*, not by module: every family reaches the same few kernels
(aten's scaled-dot-product kernels, or the libraries diffusers' attention dispatcher routes to), so
no adapter has to say where its attention is, and a plugin whose model calls some other kernel
adds it by name (:func:`gradseam.hookspecs.register_attention_kernels`). An op that is not
installed simply never matches. Math attention (``_scaled_dot_product_attention_math``) is a
composite: it reaches the dispatcher as matmuls and a softmax, so it is recomputed, exactly.

A :class:`Tape` carries the kept outputs from the checkpoint's forward to its recompute. The
checkpoint's ``context_fn`` makes the tape current on the thread (recording in the forward,
replaying in the recompute); the run layer installs a pass-through on each attention submodule the
family declares, which, only while a tape is current, enters a *gate*: a ``TorchFunctionMode`` that
lets every torch call through untouched except the ones that lead to a kernel
(``F.scaled_dot_product_attention``, or a kernel's own ``torch.ops`` entry, as flash-attn and
xformers call theirs), and runs just those under the ``TorchDispatchMode`` that keeps or replays.
Why two modes: a dispatch mode costs Python per aten op, and an attention submodule is ~110 aten ops
around one kernel (projections, norms, rotary, reshapes); a function mode costs less per call and
sees ~80. Measured: the whole block under a dispatch mode made Flux at 1k tokens 1.6x slower than
``torch``, the attention submodule under it 1.44x (docs/benchmarks.md). A family that declares no
attention side is taped block-wide, under the dispatch mode alone.

Each kept output remembers the call it came from (op, shapes, dtypes) and watches the tensor the
model went on with (:class:`_Entry`); a replay that finds another call, or an output changed in
place since (an attention processor editing its result), runs the kernel for real and counts it,
so the recompute always computes what the forward did. A call made with gradients off (a one-time calibration under
``no_grad``) is told apart from the real calls by that, so skipping it keeps the replay in step. Under ``torch.compile`` a Python
dispatch mode cannot be traced, so compiled regions use torch's own selective checkpoint with the
same kernels marked must-save: kept on the GPU, not offloaded.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only


class KernelSet:
    """Which operators count as attention kernels; answers per op object, memoised (ops are few)."""

    def __init__(self, names: Iterable[str]) -> None:
        self.names = frozenset(names)
        self._known: dict[Any, bool] = {}
        self._dropout: dict[Any, int | None] = {}  # where an op takes dropout_p, by position
        self._entries: dict[Any, bool] = {}  # torch-level callables the gate has seen -> leads to a kernel

    def __getstate__(self) -> dict[str, Any]:
        """A copy of the model (``copy.deepcopy``, pickling) takes the names, not the memos: they are keyed by
        operator objects and torch's own callables, which neither copy nor pickle, and are rebuilt at first use."""
        return {"names": self.names, "_known": {}, "_dropout": {}, "_entries": {}}

    def __call__(self, func: Any) -> bool:
        found = self._known.get(func)
        if found is None:
            schema = getattr(func, "_schema", None)
            found = self._known[func] = schema is not None and schema.name in self.names
        return found

    def keeps(self, func: Any, args: tuple, kwargs: dict | None) -> bool:
        """A kernel call whose output is worth keeping, and may be.

        * Attention over few keys (cross-attention to 512 text tokens beside 32k video tokens) costs
          little to recompute but keeps an output as large as self-attention's: only calls with at
          least a quarter as many keys as queries are kept.
        * With attention dropout the kernel draws from the generator; a replay that skipped it would
          shift every later draw of the recompute (other dropout masks) off the forward's, so such a
          call is recomputed like any other op.

        Forward and recompute see the same calls, so they decide alike, call for call.
        """
        if not self(func):
            return False
        if not _enough_keys(func, args):
            return False
        if func not in self._dropout:
            names = [a.name for a in func._schema.arguments]
            self._dropout[func] = names.index("dropout_p") if "dropout_p" in names else None
        where = self._dropout[func]
        if where is None:
            return True
        p = kwargs.get("dropout_p") if kwargs and "dropout_p" in kwargs else args[where] if where < len(args) else 0.0
        return not p

    def entry(self, func: Any) -> bool:
        """A torch-level call that leads to one of the kernels: what the gate runs under the tape's mode.

        ``F.scaled_dot_product_attention`` reaches aten's kernels (it is a composite, so a function mode
        sees it, not the kernel); a custom op is called through ``torch.ops`` (an op packet or overload,
        which a function mode sees by name, even from inside an ``autograd.Function``).
        """
        found = self._entries.get(func)
        if found is None:
            if func is _SDPA:
                found = any(n.startswith("aten::") for n in self.names)
            else:
                name = getattr(func, "_qualified_op_name", None)  # an op packet
                if name is None:
                    schema = getattr(func, "_schema", None)  # an op overload
                    name = schema.name if schema is not None else None
                found = name is not None and name in self.names
            self._entries[func] = found
        return found

    def overloads(self) -> list[Any]:
        """The installed ops' overloads, for torch's selective checkpoint (compiled regions)."""
        found = []
        for name in sorted(self.names):
            namespace, _, op = name.partition("::")
            packet = getattr(getattr(torch.ops, namespace, None), op, None)
            if packet is not None:
                found.extend(getattr(packet, o) for o in packet.overloads())
        return found


_SDPA = torch.nn.functional.scaled_dot_product_attention
_HEADS_FIRST = "aten::_scaled_dot_product_"  # (batch, heads, sequence, dim); the other kernels put heads third


def _enough_keys(func: Any, args: tuple) -> bool:
    if len(args) < 2 or not isinstance(args[0], torch.Tensor) or not isinstance(args[1], torch.Tensor):
        return True  # a kernel whose layout we do not know: keep
    dim = -2 if func._schema.name.startswith(_HEADS_FIRST) else -3
    q, k = args[0], args[1]
    if q.dim() < -dim or k.dim() < -dim:
        return True
    return 4 * k.shape[dim] >= q.shape[dim]


_sets: dict[frozenset[str], KernelSet] = {}


def kernel_set(names: frozenset[str]) -> KernelSet:
    """One memoised matcher per set of names (it caches its answer per op object)."""
    found = _sets.get(names)
    if found is None:
        found = _sets[names] = KernelSet(names)
    return found


def attention_kernels() -> KernelSet:
    """The matcher for every attention kernel installed plugins name (and the built-in ones)."""
    from ..registry import REGISTRY

    return kernel_set(REGISTRY.attention_kernels())


def _meta(func: Any, args: tuple) -> tuple[Any, ...]:
    """What identifies a kernel call for its replay: the op, whether gradients were on (a call made under
    ``no_grad`` in forward only, such as a one-time calibration, is then never mistaken for a real one),
    and each tensor argument's shape and dtype."""
    return (func, torch.is_grad_enabled(), *((a.shape, a.dtype) for a in args if isinstance(a, torch.Tensor)))


class _Entry:
    """One kept kernel call: what identifies it, what was kept, and how to tell it was edited since.

    The model goes on with the kernel's own output, so an attention processor may edit it in place
    after the tape kept it, and the kept bytes with it. An alias made here, below autograd, would not
    share the output's version counter (``detach`` in a dispatch mode gives a fresh one), so the entry
    watches the output itself (``witness``) with the version it had when kept, held only until the
    region's forward (or recompute) ends — it is alive for most of it anyway, and holding it longer
    would hold its graph — and then through weak references, which still see an edit made later
    through an alias that is alive. A replay watches the tensors it hands out the same way: an edit
    made to them in one recompute is seen by the next (a second backward).
    """

    __slots__ = ("edited", "meta", "out", "refs", "versions", "witness")

    def __init__(self, meta: tuple[Any, ...], out: Any, tensors: list[torch.Tensor]) -> None:
        self.meta, self.out = meta, out
        self.refs: tuple[weakref.ref[torch.Tensor], ...] = ()
        self.edited = False
        self.watch(tensors)

    def watch(self, tensors: list[torch.Tensor]) -> None:
        self.witness: tuple[torch.Tensor, ...] | None = tuple(tensors)
        self.versions = tuple(t._version for t in tensors)

    def settle(self) -> None:
        """The region's forward or recompute ended: note an edit made so far, then watch weakly."""
        if self.witness is not None:
            self.edited = self.edited or self._changed(self.witness)
            self.refs = tuple(weakref.ref(w) for w in self.witness)
            self.witness = None

    def changed(self) -> bool:
        if self.edited:
            return True
        if self.witness is not None:
            return self._changed(self.witness)
        return self._changed(tuple(r() for r in self.refs))

    def _changed(self, aliases: tuple[Any, ...]) -> bool:
        return any(a is not None and a._version != v for a, v in zip(aliases, self.versions))


_current = threading.local()


def current_tape() -> Tape | None:
    stack = getattr(_current, "stack", None)
    return stack[-1] if stack else None


class Tape:
    """Kept kernel outputs of one region call: recorded in its forward, replayed in its recompute.

    ``pack`` stores an output (the engine's pack, or a detach that keeps it on the GPU) and
    ``unpack`` gives it back. ``scoped``: only the attention submodules enter the dispatch mode
    (:meth:`mode`); otherwise the checkpoint's contexts enter it for the whole region.
    """

    def __init__(self, kernels: KernelSet, pack: Callable[[torch.Tensor], Any] | None = None,
                 unpack: Callable[[Any], torch.Tensor] | None = None, *, scoped: bool = True,
                 missed: Callable[[], None] | None = None) -> None:
        self.kernels, self.scoped = kernels, scoped
        self.pack, self.unpack = pack or _detach, unpack or _detach
        self.kept: list[_Entry] = []
        self.next = 0
        self.replaying = False
        self.missed = missed or (lambda: None)  # a replay that had to run the kernel for real

    # -- the checkpoint's two contexts ------------------------------------------------------
    def contexts(self) -> tuple[_Context, _Context]:
        """(forward, recompute) contexts; re-enterable, as a second backward recomputes again."""
        return _Context(self, replaying=False), _Context(self, replaying=True)

    def mode(self) -> TorchDispatchMode:
        """The dispatch mode that keeps (forward) or replays (recompute) this tape's kernel calls."""
        return _Replay(self) if self.replaying else _Keep(self)

    def gate(self) -> TorchFunctionMode:
        """What an attention submodule runs under: the dispatch mode around kernel calls only."""
        return _Gate(self)

    # -- what the modes do ------------------------------------------------------------------
    def keep(self, func: Any, args: tuple, kwargs: dict | None, out: Any) -> None:
        if not self.kernels.keeps(func, args, kwargs):
            return
        self.kept.append(_Entry(_meta(func, args), tree_map_only(torch.Tensor, self.pack, out), _tensors(out)))

    def settle(self) -> None:
        """The region's forward or recompute is over (see :class:`_Entry`)."""
        for entry in self.kept:
            entry.settle()

    def answer(self, func: Any, args: tuple, kwargs: dict | None) -> Any:
        if not self.kernels.keeps(func, args, kwargs):
            return func(*args, **(kwargs or {}))
        meta = _meta(func, args)
        for i in range(self.next, len(self.kept)):  # entries skipped over were calls made in forward only
            entry = self.kept[i]
            if entry.meta == meta:
                self.next = i + 1
                if entry.changed():
                    break  # the output was changed in place after the kernel made it: compute it again
                out = _map_kept(self.unpack, entry.out)
                entry.watch(_tensors(out))
                return out
        self.missed()
        return func(*args, **(kwargs or {}))


class _Context:
    """Makes a tape current on this thread, recording or replaying (and, block-wide, enters its mode)."""

    def __init__(self, tape: Tape, *, replaying: bool) -> None:
        self.tape, self.replaying = tape, replaying
        self._mode: TorchDispatchMode | None = None

    def __enter__(self) -> None:
        tape = self.tape
        tape.replaying = self.replaying
        if self.replaying:
            tape.next = 0  # each recompute (a second backward too) replays from the start
        stack = getattr(_current, "stack", None)
        if stack is None:
            stack = _current.stack = []
        stack.append(tape)
        if not tape.scoped:
            self._mode = tape.mode()
            self._mode.__enter__()

    def __exit__(self, *exc: object) -> None:
        if self._mode is not None:
            mode, self._mode = self._mode, None
            mode.__exit__(*exc)
        _current.stack.pop()
        self.tape.settle()


def _tensors(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _tensors(o)]
    return []


class _Keep(TorchDispatchMode):
    """The checkpoint's forward: run every op, and keep each kernel output on the tape."""

    def __init__(self, tape: Tape) -> None:
        super().__init__()
        self.tape = tape

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if self.tape.kernels(func):
            self.tape.keep(func, args, kwargs, out)
        return out


class _Gate(TorchFunctionMode):
    """Inside an attention submodule: every torch call runs as it is, except those that lead to a kernel,
    which run under the tape's dispatch mode. Inside ``__torch_function__`` torch has this mode switched
    off, so what a call does inside (a composite's own ops) is not seen again."""

    def __init__(self, tape: Tape) -> None:
        super().__init__()
        self.tape = tape

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if self.tape.kernels.entry(func):
            with self.tape.mode():
                return func(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


class _Replay(TorchDispatchMode):
    """The checkpoint's recompute: answer each kernel call with what the forward kept, checked."""

    def __init__(self, tape: Tape) -> None:
        super().__init__()
        self.tape = tape

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if self.tape.kernels(func):
            return self.tape.answer(func, args, kwargs)
        return func(*args, **(kwargs or {}))


def _map_kept(unpack: Callable[[Any], torch.Tensor], kept: Any) -> Any:
    if isinstance(kept, (tuple, list)):
        return type(kept)(_map_kept(unpack, k) for k in kept)
    if kept is None or isinstance(kept, (int, float, bool, torch.SymInt)):
        return kept
    return unpack(kept)


def _detach(t: Any) -> Any:
    # Kept on the device: an alias whose version counter is the output's own (an in-place edit shows).
    # In replay, a fresh alias per call: autograd gives each recompute's output its own node.
    return t.detach() if isinstance(t, torch.Tensor) else t


class TapeSite:
    """Installed on an attention submodule: while a tape is current, run the module under its gate."""

    __slots__ = ()

    def __call__(self, call: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        tape = current_tape()
        if tape is None or not tape.scoped or torch.compiler.is_compiling():
            return call(*args, **kwargs)
        try:
            with tape.gate():
                return call(*args, **kwargs)
        except Exception as exc:
            # flex attention compiles its own call even in eager mode, and dynamo cannot trace the gate's
            # function mode: said as what to change instead of dynamo's internal error. Torch 2.13 raises one
            # of dynamo's exceptions; torch 2.11 (H100, Kandinsky 6 SR) failed an assertion inside dynamo
            # instead ("Guard failed on the same frame it was created"), so what dynamo raised is recognised
            # by where it was raised. Anything else (the attention's own errors) passes through as it is.
            if not _from_dynamo(exc):
                raise
            from ..errors import UnsupportedStrategyError

            raise UnsupportedStrategyError(
                f"gradseam: an attention submodule ({_named(call)}) calls torch.compile inside "
                "its forward (flex attention does, even in eager mode), which cannot run while gradseam keeps or "
                "offloads its kernel outputs. Leave gradient_checkpointing_keep_attention and "
                "gradient_checkpointing_offload_attention off for this model (or for these blocks, with "
                "gradient_checkpointing_blocks); its blocks are then recomputed whole, exactly. Dynamo said: "
                f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            ) from exc


def _from_dynamo(exc: BaseException) -> bool:
    """Whether dynamo raised ``exc``: one of its exception types, or raised by code of a ``torch._dynamo`` module."""
    if isinstance(exc, torch._dynamo.exc.TorchDynamoException):
        return True
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and str(tb.tb_frame.f_globals.get("__name__", "")).startswith("torch._dynamo")


def _named(call: Callable[..., Any]) -> str:
    """The attention submodule a site wraps, by its class (the call is gradseam's :class:`Original` of it)."""
    module = getattr(call, "module", None)
    if module is not None:
        return type(module).__qualname__
    return str(getattr(call, "__qualname__", call))


def context_fn(kernels: KernelSet, pack: Callable[[torch.Tensor], Any] | None = None,
               unpack: Callable[[Any], torch.Tensor] | None = None, *, scoped: bool = True,
               missed: Callable[[], None] | None = None) -> Callable[[], tuple[Any, Any]]:
    """A ``context_fn`` for ``torch.utils.checkpoint``: kernels kept by ``pack`` (default: on the GPU)."""
    if torch.compiler.is_compiling():
        from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

        def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
            return CheckpointPolicy.MUST_SAVE if kernels.keeps(func, args, kwargs) else CheckpointPolicy.PREFER_RECOMPUTE

        return partial(create_selective_checkpoint_contexts, policy)
    tape = Tape(kernels, pack, unpack, scoped=scoped, missed=missed)
    return tape.contexts
