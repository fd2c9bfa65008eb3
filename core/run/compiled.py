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
  module is an argument, so its parameters are graph inputs, not constants.
* **No compiler without gradients.** Under ``torch.no_grad()`` (sampling, validation) the block runs
  eagerly: nothing is saved, so there is nothing to budget or offload, and a validation pass at
  another resolution costs no recompile.
* **CPU: ``aot_eager``.** It runs the same partitioner on the same graph without code generation,
  so the CPU suite checks the budget's recompute bit for bit; CUDA models use inductor.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch

from ..errors import UnsupportedStrategyError, warn_once
from .chains import ChainStats
from .scopes import refuse_transforms
from .unused import UnusedOutputs

TRACED_BY_USER = "traced by your own torch.compile (no memory budget, no offload)"


def _block_forward(function: Callable[..., Any], module: Any, args: tuple, kwargs: dict) -> Any:
    return function(module, *args, **kwargs)


def _fresh(function: types.FunctionType) -> types.FunctionType:
    """A copy of ``function`` with a code object of its own (so a cache of its own)."""
    return types.FunctionType(function.__code__.replace(), function.__globals__, function.__name__)


class CompiledBlocks:
    """The handler of every block seam of one handle's compiled regions.

    ``engine`` (or None) receives what each compiled block keeps; ``budget`` is the activation memory
    budget the partitioner plans under; ``tied`` names the parameters the model registers more than
    once (:mod:`gradseam.run.unused` leaves their gradients alone).
    """

    def __init__(self, budget: float, engine: Any = None, tied: frozenset[int] = frozenset()) -> None:
        self.budget = budget
        self.engine = engine
        self.unused = UnusedOutputs(tied)  # an output the loss leaves unused: None gradients, as in eager
        self._compiled: dict[str, Callable[..., Any]] = {}
        self._shapes: set[tuple] = set()  # the input shapes seen with gradients, up to the recompile limit
        self._past_limit = False

    def _note_shapes(self, args: tuple, kwargs: dict) -> None:
        """Warn once when the inputs have taken more shapes than dynamo keeps compiled versions of a function.

        Past ``torch._dynamo.config.recompile_limit`` dynamo runs the block eagerly: still exact, but with
        no budget and no offload, so the memory jumps without a word from the training loop. Automatic
        dynamic shapes can serve several shapes with one graph, so this counts shapes, not recompiles:
        a warning, not an error.
        """
        key = tuple(a.shape for a in args if isinstance(a, torch.Tensor)) + tuple(
            (k, v.shape) for k, v in kwargs.items() if isinstance(v, torch.Tensor))
        if key in self._shapes:
            return
        self._shapes.add(key)
        from torch._dynamo import config as dynamo_config

        limit = dynamo_config.recompile_limit
        if len(self._shapes) > limit:
            self._past_limit = True
            self._shapes.clear()  # bounded: what matters from here on is that the limit was passed
            warn_once(
                f"gradseam: the compiled blocks have seen more than {limit} input shapes "
                "(torch._dynamo.config.recompile_limit). Past that limit dynamo runs a block eagerly, still "
                "exact but without the memory budget or the offload, so its memory can jump. Train on a few "
                "fixed resolutions (aspect-ratio buckets), or raise torch._dynamo.config.recompile_limit."
            )

    def compiled(self, device: str) -> Callable[..., Any]:
        found = self._compiled.get(device)
        if found is None:
            backend = "inductor" if device == "cuda" else "aot_eager"
            found = self._compiled[device] = torch.compile(_fresh(_block_forward), backend=backend)
        return found

    def functions(self) -> list[Callable[..., Any]]:
        """The compiled functions made so far (one per device type)."""
        return list(self._compiled.values())

    def run(self, original: Any, stats: ChainStats, args: tuple, kwargs: dict) -> Any:
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
        if not self._past_limit:
            self._note_shapes(args, kwargs)
        previous = original.previous
        function, module = (_call_previous, previous) if previous is not None else (original.function, original.module)
        device = _device_of(original.module)
        import torch._functorch.config as functorch_config

        try:
            with functorch_config.patch(activation_memory_budget=self.budget):
                if self.engine is None:
                    outputs = self.compiled(device)(function, module, args, kwargs)
                else:
                    refuse_transforms("gradseam's compiled offload backend")
                    with self.engine.group():
                        outputs = self.compiled(device)(function, module, args, kwargs)
        except Exception as exc:
            if type(exc).__name__ != "BackendCompilerFailed":
                raise
            raise self._compile_failed(original.module, exc) from exc
        self.unused.watch(function, module, args, kwargs, outputs)
        return outputs

    def _compile_failed(self, block: Any, exc: Exception) -> UnsupportedStrategyError:
        """The compiler's own failure, deep in its stack, said in the user's terms with the ways out.

        Seen on the H200: a HiDream block's graph took in the engine's ``record_stream`` call, which
        inductor refuses; the eager backends run the same model."""
        name = "unsloth-compile" if self.engine is not None else "compile"
        inner = getattr(exc, "inner_exception", exc)
        first = (str(inner).strip().splitlines() or [type(inner).__name__])[0][:300]
        return UnsupportedStrategyError(
            f"backend {name!r} could not compile {type(block).__name__}: torch.compile failed "
            f"({type(inner).__name__}: {first}). Train this model with an eager backend: 'unsloth' with "
            "gradient_checkpointing_offload_attention (the least memory) or 'torch'"
            + (", or 'compile' (what the blocks keep stays on the GPU)." if name == "unsloth-compile" else ".")
        )


def _call_previous(previous: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return previous(*args, **kwargs)


def _device_of(module: Any) -> str:
    for p in module.parameters():
        return p.device.type
    return "cpu"


class CompiledMember:
    """One block's seam handler: its counts, and the handle's compiled function."""

    __slots__ = ("blocks", "stats")

    def __init__(self, blocks: CompiledBlocks, stats: ChainStats) -> None:
        self.blocks, self.stats = blocks, stats

    def __call__(self, original: Any, args: tuple, kwargs: dict) -> Any:
        return self.blocks.run(original, self.stats, args, kwargs)
