"""Compiled blocks under the compiler's activation memory budget, what they keep optionally offloaded.

Each block's forward runs through ``torch.compile``. AOTAutograd's min-cut partitioner then decides
what the block keeps for backward: with ``torch._functorch.config.activation_memory_budget = B`` it
recomputes the cheap ops (norms, activations, casts, modulation) until what it keeps fits B times
what nothing-recomputed would keep, and keeps the expensive outputs (matmuls, attention). With
``offload`` those kept tensors go to host memory through one offload-engine group per block call,
and come back by prefetch in backward: a block's working set on the GPU at no-checkpointing speed.
Why it is built this way (each point a decision, measured on the H200; docs/benchmarks.md):

* **The offload group sits outside the compiled function.** Saved-tensor hooks entered around a
  compiled call (in Python) see every tensor the compiled forward saves, after the partitioner chose
  them. ``nn.Module.compile()`` would run the module's hooks *inside* the compiled call, so the
  block itself is not compiled: a plain function calling its forward is, and the seam calls that.
* **The engine rebuilds views exactly.** The compiled backward asserts the sizes and strides of
  what it saved; ``save_on_cpu``'s contiguous copies fail those checks, the engine's storage-span
  copies with each view's own size, stride and offset pass them.
* **The budget is scoped to these calls.** It is a global read whenever a graph is partitioned
  (the first call, and every recompile for a new shape), so every call of a compiled block runs
  with gradseam's budget patched in, and nothing else ever sees it: the user's own compiled code
  keeps its own, and two patched models keep theirs.
* **One compiled function per handle.** Dynamo caches compiled code on the function's code object;
  a fresh code object per handle keeps the cache of one patched model apart from another's and
  from the user's, and ``remove()`` drops it with the handle. Blocks of one class share it: the
  module is an argument, so its parameters are graph inputs, not constants. Measuring, which patches one
  model many times over, shares them between its handles (:func:`sharing`).
* **No compiler without gradients.** Under ``torch.no_grad()`` (sampling, validation) the block runs
  eagerly: nothing is saved, so there is nothing to budget or offload, and a validation pass at
  another resolution costs no recompile.
* **CPU: ``aot_eager``.** It runs the same partitioner on the same graph without code generation,
  so the CPU suite checks the budget's recompute bit for bit; CUDA models use inductor.
* **Attention under a long broadcast mask runs outside the graph.** A block handed a mask broadcast
  over heads and queries (HunyuanVideo's and HunyuanImage 2.1's ``(B, 1, 1, N)`` key-padding mask)
  has inductor write that mask out as a dense ``(B, 1, N, N)`` bias for every attention call: its
  CUDA lowering of the memory-efficient kernel keeps a broadcast dimension only where the next stride
  is a multiple of 8, and the query dimension's next stride is 1 (``sdpa_constraint`` in
  ``torch/_inductor/lowering.py``). Measured on the H200 (docs/benchmarks.md), four HunyuanVideo
  blocks at 32,768 tokens: 51.6 GiB compiled, 8.5 GiB with nothing compiled. Where that bias would
  hold at least twice the elements of the block's floating inputs (:func:`broadcast_mask`), the block's
  declared attention submodules run eagerly for the call (a graph break around each, in a compiled
  function of its own), so the kernel gets the broadcast view as in eager: 6.8 GiB there, at
  no-checkpointing's step (818 against 815 ms). Shorter sequences stay in the graph: the bias is then small, and
  the eager attention's own saved tensors cost more (HunyuanImage 2.1 at 1,024 image tokens: 1.68x
  with them offloaded, against ~1.02x in the graph). Only the attention submodule is taken out of the
  graph (a torch-function mode around the kernel alone made dynamo break the graph at every
  ``Tensor.unflatten`` as well); what it saves goes to the same offload group. Dynamo resumes
  tracing inside the block after the break (``nested_graph_breaks``), so the compiled code stays on
  this handle's function, not on the block class's ``forward``. ``summary()`` counts these calls.
"""

from __future__ import annotations

import contextlib
import copy
import types
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map_only

from ..backends import CATALOG
from ..errors import UnsupportedStrategyError, warn_once
from ..kinds import siblings
from ..kinds.compiled import refuse_uncompilable_weights
from ..modules import device_type, resolve
from ..offload.state import is_wrapper, plain_parts
from .chains import ChainStats
from .compiler import (
    allow_retained_graph,
    compile_block_function,
    compiling,
    drop_compiled,
    frames_compiled_apart,
    warn_tuning_at_run_time,
)
from .scopes import refuse_transforms
from .unused import UnusedOutputs

TRACED_BY_USER = "traced by your own torch.compile (no memory budget, no offload)"


ATTENTION_OUTSIDE = ("attention run outside the compiled graph: the block's mask is broadcast over the queries, "
                     "which the compiler would write out as a dense bias per attention call")


BIAS_OVER_INPUTS = 2  # outside the graph from a dense bias this many times the block's floating inputs


def broadcast_mask(args: tuple, kwargs: dict) -> bool:
    """Whether a block call passes a 4-D mask broadcast over heads and queries, ``(B, 1, 1, N)``, whose dense
    ``(B, 1, N, N)`` bias would hold at least :data:`BIAS_OVER_INPUTS` times the elements of the block's
    floating inputs together (hidden states, text states, embeddings).

    The factor sits between two measurements on the H200: HunyuanImage 2.1 at 1,024 image + 1,128 text
    tokens (bias 1.1x its inputs) is faster with the bias in the graph (~1.02x none, 1.68x with its
    attention eager and what that saves offloaded); HunyuanVideo at 8,192 tokens (2.6x) is smaller and
    faster with it out (1.73 GiB at 81 ms against 3.96 GiB at 91 ms, four blocks). Only the block's
    own arguments are looked at (a mask built inside the block is the compiler's to see); rotary
    tables and hidden states never have both middle dimensions of size 1 with a longer last one.
    """
    values = (*args, *kwargs.values())
    inputs = sum(v.numel() for v in values if isinstance(v, torch.Tensor) and v.is_floating_point())
    for value in values:
        if (isinstance(value, torch.Tensor) and value.dim() == 4 and value.shape[1] == 1 and value.shape[2] == 1
                and value.shape[3] > 1 and (value.dtype == torch.bool or value.is_floating_point())
                and value.shape[0] * value.shape[3] ** 2 >= BIAS_OVER_INPUTS * inputs):
            return True
    return False


def _block_forward(function: Callable[..., Any], module: Any, args: tuple, kwargs: dict) -> Any:
    return function(module, *args, **kwargs)


def _block_forward_own_outputs(function: Callable[..., Any], module: Any, args: tuple, kwargs: dict) -> Any:
    """The block's forward, each tensor it returns cloned, so no two alias one another or an input.

    For blocks holding tensor-subclass weights (torchao's Float8Tensor and Int8Tensor, optimum-quanto's
    WeightQBytesTensor): AOTAutograd refuses any output aliasing in a graph with tensor-subclass inputs
    ("two graph outputs that alias one another"), and Flux's single-stream block returns its text and
    image tokens as two slices of one tensor, so neither ``torch.compile(block)`` nor
    :func:`_block_forward` compiles it. Every output is cloned, because which ones alias cannot be read
    inside the trace (``_is_view`` is not traced); a clone is the identity both ways, so values and
    gradients are the same bits, and inductor writes a clone of a pointwise result straight into its own
    buffer. Only for such blocks: elsewhere the clones would be a change for nothing, and where a graph
    break ends the block (diffusers' group offloading hooks) the clones would land in a graph of their own,
    hiding the block's parameters from :mod:`gradseam.run.unused`.
    """
    return tree_map_only(torch.Tensor, torch.clone, function(module, *args, **kwargs))


def subclass_weights(block: nn.Module) -> tuple[bool, bool]:
    """Whether a parameter or buffer of ``block`` is a wrapper tensor subclass (a quantized weight), and
    whether one of those holds int8 data (torchao's Int8Tensor, quanto's qint8): the compiled function's
    two variants for quantized blocks (:meth:`CompiledBlocks.compiled`)."""
    wrappers = [t for t in (*block.parameters(), *block.buffers()) if is_wrapper(t)]
    return bool(wrappers), any(part.dtype == torch.int8 for t in wrappers for part in plain_parts(t))


def _fresh(function: types.FunctionType) -> types.FunctionType:
    """A copy of ``function`` with a code object of its own (so a cache of its own)."""
    return types.FunctionType(function.__code__.replace(), function.__globals__, function.__name__)


# the compiled functions of the innermost :func:`sharing` scope, by CompiledBlocks key and budget (none outside one),
# each with the code object dynamo keeps its graphs on
_SHARED: list[dict[tuple[Any, ...], tuple[Callable[..., Any], types.CodeType]]] = []
ROOM = 2  # graphs a shared function must still have room for under dynamo's recompile limit, or a fresh one starts


def _full(code: types.CodeType) -> bool:
    """Whether dynamo holds so many graphs for ``code`` that a patch adding a few would pass its recompile limit,
    past which it runs the function eagerly (no budget, no offload: a measurement of the wrong thing)."""
    from torch._dynamo import config as dynamo_config
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    return len(_debug_get_cache_entry_list(code)) > dynamo_config.recompile_limit - ROOM


@contextlib.contextmanager
def sharing() -> Iterator[None]:
    """Within the block, every handle made takes its compiled block functions from one shared table, keyed as a
    handle keys them and by the memory budget, so a function compiled for one patch serves the next.

    Why: measuring (``auto``'s planning, ``advise``) patches each compiled candidate once per depth, and the plan
    once more on the whole model, and each patch compiled its blocks afresh, one compiled function per handle. On
    the CPU, patching tiny Flux under ``compile`` again took 2.7 s at its first step (dynamo, AOTAutograd and the
    partitioner again), where the same step under one patch took 0.03 s. A shared function serves a new patch
    wherever dynamo's guards pass (the same block classes, shapes and dtypes; the budget is in the key, since the
    partitioner reads it when it compiles; the offload group and the eager attention sit outside the compiled
    call). Where they do not, dynamo compiles a graph of its own, as for a new shape: sharing saves compiling, it
    never changes what runs. A shared function near dynamo's recompile limit (:data:`ROOM`) is not handed on: the
    next patch compiles a fresh one, so no measurement runs a block eagerly past the limit. Outside a scope each handle keeps its own functions, so two patched models in one
    training process never share a cache. Bench does not share: its compiled rows report their first step's
    compile time."""
    _SHARED.append({})
    try:
        yield
    finally:
        _SHARED.pop()


# torch.compile's own failures (dynamo handing the graph to inductor, inductor lowering it), by name: dynamo's and
# inductor's exception modules move between torch versions
COMPILER_FAILURES = ("BackendCompilerFailed", "InductorError")


def compiler_said(exc: BaseException) -> str:
    """What the compiler's failure ``exc`` says, in one line (``"RuntimeError: Found a custom ..."``): the exception
    it wraps (dynamo's ``inner_exception``) and its first line, at most 300 characters."""
    inner = getattr(exc, "inner_exception", None) or exc
    first = (str(inner).strip().splitlines() or [type(inner).__name__])[0][:300]
    return f"{type(inner).__name__}: {first}"


class CompiledBlocks:
    """The handler of every block seam of one handle's compiled regions.

    ``engine`` (or None) receives what each compiled block keeps; ``budget`` is the activation memory
    budget the partitioner plans under (:mod:`gradseam.run.compiler` says how blocks are compiled).
    """

    def __init__(self, budget: float, engine: Any = None, *, backend: str) -> None:
        self.budget = budget
        self.engine = engine
        self.backend = backend  # the catalog name, for messages
        self.unused = UnusedOutputs()  # an output the loss leaves unused: None gradients, as in eager
        self._compiled: dict[tuple[str, bool, bool, bool, type | None], Callable[..., Any]] = {}
        # per block: subclass_weights(block), read again at each new input shape (a compile)
        self._subclass_weights: weakref.WeakKeyDictionary[nn.Module, tuple[bool, bool]] = weakref.WeakKeyDictionary()
        self._eager: dict[int, tuple[nn.Module, Any, Callable[..., Any]]] = {}  # id(sub) -> (sub, inner, wrapper)
        # the input shapes seen with gradients per block class (each class compiles apart), to the recompile limit
        self._shapes: dict[type, set[tuple]] = {}
        self._past_limit: set[type] = set()
        self._apart: dict[str, Any] = {}  # functions dynamo compiled on their own after a graph break

    def __getstate__(self) -> dict[str, Any]:
        """Pickling the model (``torch.save(model)``) takes the budget, the engine and the backend, not the caches:
        compiled functions, dynamo's frames and the per-block weak maps do not pickle. The unpickled model compiles
        its blocks at their first call, as a fresh patch does."""
        return {"budget": self.budget, "engine": self.engine, "backend": self.backend}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["budget"], state["engine"], backend=state["backend"])

    def __deepcopy__(self, memo: dict[int, Any]) -> CompiledBlocks:
        """``copy.deepcopy`` copies everything as before, the compiled functions shared (they take the block as an
        argument); only pickling starts afresh (:meth:`__getstate__`)."""
        clone = object.__new__(type(self))
        memo[id(self)] = clone
        clone.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return clone

    def _check_apart(self, block: nn.Module) -> None:
        """After a call that compiled (a new input shape): warn once if a graph break made dynamo compile
        functions of the block's classes on their own (:func:`gradseam.run.compiler.frames_compiled_apart`),
        and remember them, to drop their compiled code at :meth:`close`."""
        apart = frames_compiled_apart(block)
        if apart:
            self._apart.update(apart)
            warn_once(
                f"gradseam: a graph break inside {type(block).__name__} made torch.compile compile "
                f"{', '.join(apart)} as frames of their own. Those graphs are shared by every model of that "
                "class and keep the memory budget of the first model that ran them, until this patch is "
                "removed. Patch one such model at a time, or use an eager backend ('unsloth' with "
                "gradient_checkpointing_offload_attention, or 'torch') for this one."
            )

    def close(self) -> None:
        """The handle is removed: drop what dynamo compiled for the frames compiled apart."""
        drop_compiled(self._apart.values())
        self._apart.clear()

    def _note_shapes(self, block_class: type, args: tuple, kwargs: dict) -> bool:
        """Warn once when the inputs have taken more shapes than dynamo keeps compiled versions of a function.

        Past ``torch._dynamo.config.recompile_limit`` dynamo runs the block eagerly: still exact, but with
        no budget and no offload, so the memory jumps without a word from the training loop. Automatic
        dynamic shapes can serve several shapes with one graph, so this counts shapes, not recompiles:
        a warning, not an error. Returns whether the shapes are new (so the call may compile).
        """
        key = tuple(a.shape for a in args if isinstance(a, torch.Tensor)) + tuple(
            (k, v.shape) for k, v in kwargs.items() if isinstance(v, torch.Tensor))
        shapes = self._shapes.setdefault(block_class, set())
        if key in shapes:
            return False
        shapes.add(key)
        from torch._dynamo import config as dynamo_config

        limit = dynamo_config.recompile_limit
        if len(shapes) > limit:
            self._past_limit.add(block_class)
            shapes.clear()  # bounded: what matters from here on is that the limit was passed
            warn_once(
                f"gradseam: the compiled blocks have seen more than {limit} input shapes "
                "(torch._dynamo.config.recompile_limit). Past that limit dynamo runs a block eagerly, still "
                "exact but without the memory budget or the offload, so its memory can jump. Train on a few "
                "fixed resolutions (aspect-ratio buckets), or raise torch._dynamo.config.recompile_limit."
            )
        return True

    def compiled(self, device: str, outside: bool = False, own_outputs: bool = False,
                 int8_weights: bool = False, block_class: type | None = None) -> Callable[..., Any]:
        """The compiled block function for ``device``; ``outside``: the one whose blocks run their attention
        eagerly; ``own_outputs``: the one that clones what the block returns (blocks with quantized weights,
        :func:`_block_forward_own_outputs`); ``int8_weights``: the one compiled without inductor's pattern
        matcher (:func:`gradseam.run.compiler.compile_block_function` says why). Each its own code object, so
        their graphs never evict each other.

        ``block_class``: every block class has code objects of its own too, so each class counts against
        dynamo's recompile limit apart (HunyuanVideo 1.5's token-refiner and trunk blocks, Flux's double- and
        single-stream blocks, each with a first block whose input is laid out unlike the rest's, make four
        graphs in one function) and its graphs never evict another class's. Through one function, dynamo's
        automatic dynamic shapes also made the trunk's third graph symbolic in the token count for 53 of its
        54 blocks (the ``[0/2]`` frame seen on the H200 with HunyuanVideo 1.5); the blocks now compile with
        ``dynamic=False`` (:func:`gradseam.run.compiler.compile_block_function`)."""
        key = (device, outside, own_outputs, int8_weights, block_class)
        found = self._compiled.get(key)
        if found is None:
            shared = _SHARED[-1] if _SHARED else None
            entry = shared.get((*key, self.budget)) if shared is not None else None
            if entry is None or _full(entry[1]):
                body = _fresh(_block_forward_own_outputs if own_outputs else _block_forward)
                entry = (compile_block_function(body, device, pattern_matcher=not int8_weights), body.__code__)
                if shared is not None:
                    shared[(*key, self.budget)] = entry
            found = self._compiled[key] = entry[0]
        return found

    def functions(self) -> list[Callable[..., Any]]:
        """The compiled functions made so far (per device type, with and without eager attention)."""
        return list(self._compiled.values())

    @contextlib.contextmanager
    def _attention_eager(self, subs: Sequence[nn.Module]) -> Iterator[None]:
        """Each of ``subs`` called through a ``torch.compiler.disable``-d forward, for the block call only.

        A submodule's wrapper is made once and kept: dynamo guards on the object it finds there, so a new
        one per call would recompile every call. Whatever ``forward`` the instance had is put back after.
        """
        missing = object()
        before = []
        for sub in subs:
            inner = sub.__dict__.get("forward", missing)
            cached = self._eager.get(id(sub))
            if cached is None or cached[0] is not sub or cached[1] is not inner:
                call = sub.forward if inner is missing else inner
                cached = self._eager[id(sub)] = (sub, inner, torch.compiler.disable(call, recursive=True))
            before.append((sub, inner))
            sub.forward = cached[2]
        try:
            yield
        finally:
            for sub, inner in before:
                if inner is missing:
                    del sub.__dict__["forward"]
                else:
                    sub.__dict__["forward"] = inner

    def run(self, original: Any, stats: ChainStats, args: tuple, kwargs: dict,
            attention: tuple[str, ...] = ()) -> Any:
        if not torch.is_grad_enabled():
            return original(*args, **kwargs)
        if torch.compiler.is_compiling():
            # The user's own torch.compile traces this block (``torch.compile(model)`` after patching; the
            # other idioms are refused before the forward): it runs, exactly, but in their graph, without
            # this budget or offload. Counted (dynamo replays the mutation on every call of that graph), so
            # summary() says it; a warning here would break their graph.
            stats.fallbacks[TRACED_BY_USER] += 1
            return original(*args, **kwargs)
        stats.member_calls[0] += 1
        stats.runs += 1
        block_class = type(original.module)
        new_shape = block_class not in self._past_limit and self._note_shapes(block_class, args, kwargs)
        if new_shape:  # before a compile: weights cast or packed after patching are refused as at patch time
            refuse_uncompilable_weights(original.module, self.backend)
            warn_tuning_at_run_time(device_type(original.module))
        weights = self._subclass_weights.get(original.module)
        if weights is None or new_shape:
            weights = self._subclass_weights[original.module] = subclass_weights(original.module)
        previous = original.previous
        function, module = (_call_previous, previous) if previous is not None else (original.function, original.module)
        device = device_type(original.module)
        subs = _attention_modules(original.module, attention) if attention and broadcast_mask(args, kwargs) else []
        if subs:
            stats.notes[ATTENTION_OUTSIDE] += 1
        compiled = self.compiled(device, outside=bool(subs), own_outputs=weights[0], int8_weights=weights[1],
                                 block_class=block_class)
        try:
            with compiling(self.budget), self._attention_eager(subs) if subs else contextlib.nullcontext():
                if self.engine is None:
                    outputs = compiled(function, module, args, kwargs)
                else:
                    refuse_transforms("gradseam's compiled offload backend")
                    with self.engine.group():
                        outputs = compiled(function, module, args, kwargs)
        except Exception as exc:
            if type(exc).__name__ not in COMPILER_FAILURES:
                raise
            raise self._compile_failed(original.module, exc) from exc
        if new_shape:
            self._check_apart(original.module)
        allow_retained_graph(outputs)
        self.unused.watch(function, module, original.module, args, kwargs, outputs)
        return outputs

    def _compile_failed(self, block: Any, exc: Exception) -> UnsupportedStrategyError:
        """The compiler's own failure, deep in its stack, said in the user's terms with the ways out.

        Seen on the H200: a HiDream block's graph took in the engine's ``record_stream`` call, which
        inductor refuses; the eager backends run the same model."""
        staying = [b.name for b in siblings(CATALOG[self.backend]) if not b.moves] if self.engine is not None else []
        return UnsupportedStrategyError(
            f"backend {self.backend!r} could not compile {type(block).__name__}: torch.compile failed "
            f"({compiler_said(exc)}). Train this model with an eager backend: 'unsloth' with "
            "gradient_checkpointing_offload_attention (the least memory) or 'torch'"
            + (f", or {staying[0]!r} (the same block compiled without the offload, what it keeps staying on the GPU), "
               "which helps where the offload is what the compiler refused (HiDream's was) and fails alike where "
               "it is the block's own code (Nucleus-Image's expert layer)." if staying else ".")
        )


def _attention_modules(block: Any, paths: tuple[str, ...]) -> list[nn.Module]:
    found = [resolve(block, path) for path in paths]
    return [sub for sub in found if isinstance(sub, nn.Module)]


def _call_previous(previous: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return previous(*args, **kwargs)


class CompiledMember:
    """One block's seam handler: its counts, and the handle's compiled function."""

    __slots__ = ("attention", "blocks", "stats")

    def __init__(self, blocks: CompiledBlocks, stats: ChainStats, attention: tuple[str, ...] = ()) -> None:
        self.blocks, self.stats, self.attention = blocks, stats, attention  # attention: the block's submodule paths

    def __call__(self, original: Any, args: tuple, kwargs: dict) -> Any:
        return self.blocks.run(original, self.stats, args, kwargs, self.attention)
