"""How gradseam's compiled blocks are compiled: the backend, the partitioner, the settings scoped to them.

:mod:`gradseam.run.compiled` decides *when* a block runs compiled; this module says *how*, so every
setting that changes what a compiled block computes or keeps has one home. Why each one:

* **Random ops are saved, never recomputed.** Under a memory budget below 1 the partitioner may put
  a random op (dropout's mask, ``rand_like``) among what backward recomputes; the recompute draws
  fresh numbers, so the gradients are taken against other masks than the forward used (PEFT LoRA
  dropout 0.1 on Flux: off by ~2e-3) and the extra draws move the generator, changing every later
  step's noise and timesteps. :class:`RandomOpsSaved` marks every op that draws from a generator
  ``MUST_SAVE`` in the joint graph before the partitioner runs, so its output is kept (or offloaded
  with the rest) whatever the budget: the masks backward sees are the forward's, and the generator
  is left where the unpatched step leaves it. The marking is the same one torch's selective
  checkpointing uses, read by the partitioner's budget solver too.
* **On CUDA, random ops draw from torch's generator** (``fallback_random``): inductor would otherwise
  generate its own masks from its own seeds, right in distribution but not the unpatched model's,
  and not where the generator would be after an eager step.
* **No donated buffers.** AOTAutograd lets a backward reuse the memory of what its forward saved
  ("donated buffers") and then refuses a second backward through the same graph
  (``backward(retain_graph=True)``), with an error naming neither gradseam nor the backend. The
  compiled blocks are compiled without them, so a retained graph runs backward twice as in eager.
* **Graph breaks resume inside the block** (``nested_graph_breaks``, torch >= 2.9). Without it a
  break inside a block (HiDream's MoE routing) goes up to gradseam's compiled function, and the
  block's code after it is compiled as frames of diffusers' own class-level functions, whose cache
  every handle shares and ``remove()`` cannot drop: a second model patched under another budget ran
  the first model's graphs, partitioned under the first budget.
* **Frames compiled apart are named and dropped.** A graph break dynamo cannot resume from (HiDream's
  MoE routing: a ``nonzero`` inside a loop) skips the frame that holds it, and dynamo then compiles
  each function that frame calls (the experts, the gate) on its own code object, shared by every
  model and handle and partitioned under whichever budget ran it first. gradseam names them in a
  warning (:func:`frames_compiled_apart`) and drops their compiled code when the handle is removed,
  so a model patched later compiles them under its own budget. (Capturing the data-dependent shapes
  instead, ``capture_dynamic_output_shape_ops``, kept HiDream in one graph on the CPU but inductor
  failed on it on the H200: "AssertionError: u24 -> u3".)
* **Hooks are guarded** (``skip_nnmodule_hook_guards`` off): blocks of one class share one compiled
  function, and without the guard a graph traced for a block without hooks served a block whose
  submodule has a forward hook (a REPA-style feature capture), which then never fired.
* **Run-time kernel tuning is named, not overridden.** With inductor's coordinate-descent tuning on,
  every kernel of a compiled block is tuned at its first run, compiling each candidate configuration:
  on the H200 a Flux dev block pair at 4k tokens with torchao fp8 weights had not finished its first
  step after 110 s (docs/benchmarks.md). torchao's ``quantize_`` turns the setting on for the whole
  process unless its config says ``set_inductor_config=False``, so a user who never asked for it pays
  minutes per compile. It is the user's process-wide choice, so gradseam leaves it as it is and says
  so once (:func:`warn_tuning_at_run_time`), naming the cause and the two ways to turn it off.
* **The budget is patched in around each call** (it is a global the partitioner reads whenever it
  partitions a graph: the first call and every recompile), so nothing else ever sees it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import fx

from ..errors import warn_once


def is_random(node: fx.Node) -> bool:
    """Whether a joint-graph node draws from a random generator (dropout, ``rand_like``, ``bernoulli``...).

    The operator's ``nondeterministic_seeded`` tag says so; inductor's own random prims never appear,
    since the blocks compile with ``fallback_random``."""
    return node.op == "call_function" and torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ())


def save_random_ops(graph: fx.Graph | fx.GraphModule) -> int:
    """Mark every random op of the joint graph ``MUST_SAVE`` for the partitioner; the number marked."""
    from torch.utils.checkpoint import CheckpointPolicy

    marked = 0
    for node in getattr(graph, "graph", graph).nodes:
        if is_random(node):
            node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
            marked += 1
    return marked


def _partition(joint: fx.GraphModule, joint_inputs: Sequence[object], **kwargs: Any) -> tuple[Any, Any]:
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    save_random_ops(joint)
    return min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)


def _inductor_partitioner() -> Any:
    """The partitioner handed to inductor: the default min-cut one after :func:`save_random_ops`."""
    from torch._inductor.custom_graph_pass import CustomPartitionerFn

    class RandomOpsSaved(CustomPartitionerFn):
        def __call__(self, gm: fx.GraphModule, joint_inputs: Sequence[object], **kwargs: Any) -> Any:
            return _partition(gm, joint_inputs, **kwargs)

        def uuid(self) -> Any:  # part of inductor's cache key: the partitioner's code is this file
            from torch._inductor.custom_graph_pass import get_hash_for_files

            return get_hash_for_files((__file__,))

        def __reduce__(self) -> Any:  # inductor pickles its settings into its cache key
            return (_inductor_partitioner, ())

    return RandomOpsSaved()


def _inductor_pre_pass() -> Any:
    """The same marking as a joint-graph pre-pass, for an inductor without ``custom_partitioner_fn``."""
    from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

    class RandomOpsSavedPass(CustomGraphPass):
        def __call__(self, graph: fx.Graph) -> None:
            save_random_ops(graph)

        def uuid(self) -> Any:
            return get_hash_for_files((__file__,))

        def __reduce__(self) -> Any:
            return (_inductor_pre_pass, ())

    return RandomOpsSavedPass()


def _cpu_backend() -> Callable[..., Any]:
    """``aot_eager`` with :func:`_partition`: the same partitioner on the same graph, no code generation, so
    the CPU suite checks the budget's recompute bit for bit."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch._aot_autograd.utils import make_boxed_func

    def nop(gm: fx.GraphModule, _: Any) -> Any:
        return make_boxed_func(gm.forward)

    return aot_autograd(fw_compiler=nop, bw_compiler=nop, partition_fn=_partition,
                        keep_inference_input_mutations=True)


def compile_block_function(function: Callable[..., Any], device: str, *, pattern_matcher: bool = True
                           ) -> Callable[..., Any]:
    """``function`` under ``torch.compile`` for blocks on ``device`` ("cuda": inductor; else aot_eager).

    ``pattern_matcher=False``: inductor's graph pattern rewrites off, for blocks with int8 weights. With
    torchao's Int8Tensor weights and a memory budget below 1, Flux dev's double-stream block failed to
    lower on the H200 ("LoweringException: AssertionError" on a ``sum`` over an axis its input lacks);
    at budget 1 or with the pattern matcher off it compiled and ran (docs/benchmarks.md), and plain
    ``torch.compile`` of the same block ran too. The rewrites fuse and reorder ops: without them the kernels
    differ (rounding, speed), not what the block computes."""
    # dynamic=False: every block class compiles static graphs, one per input layout (sizes and strides).
    # Under dynamo's default, a function's second compile for a changed size or stride makes it symbolic:
    # Flux's first single-stream block takes its tokens laid out unlike the later ones (views of the joint
    # text and image tensor), so 37 of its 38 single blocks ran a dynamic-shape graph, planned by the
    # partitioner from size hints. Static graphs plan the memory budget on the real sizes; new shapes
    # (aspect buckets) recompile up to dynamo's recompile limit, which CompiledBlocks warns about.
    if device != "cuda":
        return torch.compile(function, backend=_cpu_backend(), dynamic=False)
    from torch._inductor import config as inductor_config

    options: dict[str, Any] = {"fallback_random": True}
    if not pattern_matcher:
        options["pattern_matcher"] = False
    if hasattr(inductor_config, "custom_partitioner_fn"):
        options["custom_partitioner_fn"] = _inductor_partitioner()
    else:
        options["joint_custom_pre_pass"] = _inductor_pre_pass()
    return torch.compile(function, backend="inductor", options=options, dynamic=False)


TUNING_AT_RUN_TIME = (
    "gradseam: torch._inductor.config.coordinate_descent_tuning is on, so every kernel of the compiled blocks "
    "is tuned at its first run, one compile per candidate: a real model's first step can take many minutes "
    "(Flux dev with torchao fp8 weights on an H200: over 110 s for one block pair). torchao's quantize_ turns "
    "it on for the whole process unless its config says set_inductor_config=False (e.g. "
    "Float8WeightOnlyConfig(set_inductor_config=False), also through diffusers' TorchAoConfig). Quantize that "
    "way, or set torch._inductor.config.coordinate_descent_tuning = False before training; gradseam leaves "
    "the setting as it is."
)


def warn_tuning_at_run_time(device: str) -> None:
    """Warn once when the blocks about to compile for ``device`` will be tuned at run time (see the module
    docstring): inductor's coordinate-descent tuning is a CUDA-side cost, the CPU backend generates no code."""
    from torch._inductor import config as inductor_config

    if device == "cuda" and inductor_config.coordinate_descent_tuning:
        warn_once(TUNING_AT_RUN_TIME)


@contextlib.contextmanager
def compiling(budget: float) -> Iterator[None]:
    """The settings every call of a compiled block runs under (see the module docstring)."""
    import torch._functorch.config as functorch_config
    from torch._dynamo import config as dynamo_config

    settings: dict[str, Any] = {"activation_memory_budget": budget}
    if hasattr(functorch_config, "donated_buffer"):
        settings["donated_buffer"] = False
    dynamo: dict[str, Any] = {"skip_nnmodule_hook_guards": False}
    if hasattr(dynamo_config, "nested_graph_breaks"):
        dynamo["nested_graph_breaks"] = True
    with functorch_config.patch(**settings), dynamo_config.patch(**dynamo):
        yield


def frames_compiled_apart(block: torch.nn.Module) -> dict[str, Any]:
    """The functions of ``block``'s submodule classes that dynamo compiled as frames of their own, by name,
    with their code objects.

    That happens when a graph break dynamo cannot resume from (one inside a loop) skips the frame that
    holds it: each function it calls is then compiled on its own code object, shared by every model and
    handle, partitioned under whichever budget was in force when it was first compiled."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    found = {}
    for cls in {type(m) for m in block.modules()}:
        for name, value in vars(cls).items():
            code = getattr(value, "__code__", None)
            if code is not None and _debug_get_cache_entry_list(code):
                found[f"{cls.__name__}.{name}"] = code
    return dict(sorted(found.items()))


def drop_compiled(codes: Any) -> None:
    """Forget dynamo's compiled code for these code objects (the next call compiles afresh)."""
    from torch._C._dynamo.eval_frame import reset_code

    for code in codes:
        reset_code(code)


def allow_retained_graph(outputs: Any) -> None:
    """Let ``backward(retain_graph=True)`` run through the compiled nodes ``outputs`` come from.

    The blocks are compiled without donated buffers (:func:`compiling`), so nothing of what they saved is
    reused by their backward and a second backward is safe. But AOTAutograd's backward checks the global
    ``donated_buffer`` setting against a graph task that keeps its graph, and records "none collected" as
    ``None`` rather than ``[]``, so the check refuses every retained backward of a graph compiled without
    them (the setting is per thread, so patching it around the node's backward does not reach it). The
    graph's record is set to what it means: no donated buffer."""
    from torch.utils._pytree import tree_leaves

    for t in tree_leaves(outputs):
        if isinstance(t, torch.Tensor) and t.requires_grad:
            base = t._base if t._is_view() and t._base is not None else t
            metadata = getattr(getattr(base.grad_fn, "_forward_cls", None), "metadata", None)
            if metadata is not None and getattr(metadata, "bw_donated_idxs", []) is None:
                metadata.bw_donated_idxs = []
