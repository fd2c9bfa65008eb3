"""Frozen weights that live in host memory and come to the GPU block by block, while their block runs.

A model whose weights do not fit the card trains when the frozen base weights of some blocks stay in
host memory and are copied to the GPU only for the block's forward, its recompute and its backward
(issue 40). This module is the mechanism; which blocks stream, and what is refused, is decided above
it (:mod:`gradseam.planning`, :mod:`gradseam.handle`). Why it is built this way:

* **The parameter stays the same object; its ``.data`` moves.** Optimizers, PEFT's ``base_layer``,
  ``state_dict()`` keys and the user's own references all hold the ``nn.Parameter``; swapping what it
  points at keeps every one of them valid. Between model calls every streamed tensor points at its
  host copy, so ``state_dict()`` and ``load_state_dict()`` read and write the real values.
* **Hooks where FSDP2 has them**, so it composes with gradseam's regions as FSDP2 does (the chains
  already run a block with forward pre-hooks as its own region): a forward pre-hook loads the block,
  a forward hook releases it and hangs a hook on each output that needs a gradient; that hook loads
  the block again when its gradient arrives, before any of the block's backward runs (the checkpoint
  recompute runs inside that backward, so it finds the weights there), and releases every streamed
  block after it in forward order, whose backward is then done. A callback at the end of backward
  releases the last one. A forward run inside backward (torch's own checkpoint calling the block
  again) releases nothing.
* **Only frozen tensors stream.** They are copied host-to-device only, never back: nothing writes to
  them. A trainable parameter (a LoRA) stays where it is; one that starts training after patching is
  refused at its block's next load, naming it (the caller supplies the error type).
* **Copies on a side stream, one block ahead.** A block's copy is issued on a copy stream while the
  block before it computes: in forward when block ``i`` starts, block ``i + 1`` is copied; in backward
  when block ``i``'s gradient arrives, block ``i - 1`` is (``prefetch`` blocks ahead, default 1, so
  ``1 + prefetch`` blocks' weights are on the GPU at a time). "Before" counts streamed blocks only, so a
  copy overlaps every resident block between two streamed ones (why the planner spreads them). "Next"
  is the order the blocks ran in the last forward, learnt as they run, not the order of the model's lists:
  a model that alternates two lists (Latte's spatial and temporal blocks) would otherwise prefetch a block
  that does not run next, and wait for every other copy. The first forward prefetches in list order. The first
  streamed block is copied when the model's forward starts, the last one when it ends (its backward comes
  first), so neither waits on the host link unless nothing runs beside it. The destination is allocated from the
  compute stream, so the caching allocator hands it back to compute-stream work once released, as any
  other tensor; the copy stream first waits for the work queued on the compute stream (that memory may
  have been freed by kernels not yet run), and the compute stream waits for the copy's event before the
  block's first kernel. A prefetched block released unused (the forward ended early) is waited for
  before its memory goes back, so no later kernel can get memory the copy still writes.
* **The host copies are pinned when CUDA allows it** (``cudaHostRegister`` on one buffer per block and dtype,
  as the activation pool does, :mod:`gradseam.offload.pinned`); if pinning fails the copies are
  pageable, with one warning, never a crash. Pinned, they count toward the process's pinned total with
  the offloaded activations, which warns once past a share of the host's memory.
* **``model.to(...)`` leaves them in host memory.** Moving the patched model to the GPU (the way to
  train a model too large for it: build on the CPU, patch, move) must not bring the streamed
  weights along: each module holding one skips them in ``_apply`` and records the device they are
  to be used on. A dtype change would need new host copies: refused, naming the tensor.
* **A copy of the model streams its own weights.** The hooks (partials of the stream's methods) and the
  ``_apply`` guards (objects) hold the stream, not closures, so ``copy.deepcopy`` (an EMA copy) and pickling carry a stream over that loads the copy's
  blocks from the copy's host memory (plain, never pinned or counted).
* **The CPU test mode** lets a CPU model stand in: the "device" copy is a fresh CPU tensor, so the
  suite checks the loads, the releases and the exactness without a GPU.
"""

from __future__ import annotations

import functools
import mmap
import os
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .pinned import pageable, register_pinned, unregister_pinned

ALIGN = 64  # bytes: each tensor's host copy starts on a multiple, as the allocator's own blocks do
_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, stacklevel=3)


FRAGMENTATION = (
    "gradseam: weights stream block by block, and PyTorch's CUDA allocator runs without expandable segments: "
    "memory freed by each released block stays reserved in pieces that larger tensors may not fit, so a model "
    "that fits can run out of memory (HunyuanVideo 1.5 under a 24 GiB cap, every block streamed: out of memory "
    "with 17.5 GiB reserved but unallocated; with expandable segments, a 10.2 GiB peak). Set "
    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True in the environment before the process first uses CUDA."
)


def expandable_segments() -> bool:
    """Whether PyTorch's CUDA caching allocator maps its segments expandably (``PYTORCH_CUDA_ALLOC_CONF`` or
    its newer name ``PYTORCH_ALLOC_CONF``, read as torch reads them: comma-separated ``key:value`` pairs)."""
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        for item in os.environ.get(name, "").split(","):
            key, _, value = item.partition(":")
            if key.strip() == "expandable_segments":
                return value.strip().lower() == "true"
    return False


@dataclass
class _Tensor:
    """One streamed parameter or buffer: the object every reference holds, and its host copy."""

    name: str  # its path in the block, for messages
    tensor: torch.Tensor
    host: torch.Tensor
    home: torch.device  # where remove() puts it: where it was when streaming began, then where the model moved


@dataclass
class _Buffer:
    """Host memory of one block and one dtype: each of the block's host copies of that dtype is a view of it. One
    buffer per dtype, not per block: ``torch.save`` refuses views of one storage in two dtypes, so a ``state_dict()``
    of a block mixing bf16 weights and fp32 norms (Wan's, as diffusers loads it) could not be saved."""

    memory: torch.Tensor | None  # None in a copy of the model (copy.deepcopy, pickling): only the views remain
    pinned: bool
    nbytes: int


@dataclass
class _Block:
    module: nn.Module
    label: str
    tensors: list[_Tensor]
    buffers: list[_Buffer]  # the block's host memory
    loaded: bool = False
    copied: Any = None  # the copy stream's event for a load the compute stream has not waited for yet
    borrowed: bool = False  # its host copies are a set-aside stream's, lent while "auto" measures (lender)

    @property
    def nbytes(self) -> int:
        return sum(buffer.nbytes for buffer in self.buffers)

    @property
    def pinned_bytes(self) -> int:
        return sum(buffer.nbytes for buffer in self.buffers if buffer.pinned)


def streamable(block: nn.Module) -> Iterator[tuple[str, nn.Module, str, torch.Tensor]]:
    """(path, owner, attribute, tensor) of every frozen parameter and every buffer of ``block``, each once."""
    seen: set[int] = set()
    for path, owner in block.named_modules():
        for kind in ("_parameters", "_buffers"):
            for name, t in getattr(owner, kind).items():
                if t is None or id(t) in seen or (kind == "_parameters" and t.requires_grad):
                    continue
                seen.add(id(t))
                yield (f"{path}.{name}" if path else name), owner, name, t


def block_part(block: nn.Module, path: str) -> nn.Module | torch.Tensor | None:
    """The submodule, parameter or buffer of ``block`` at ``path``, or None where the block has none."""
    owner, _, name = path.rpartition(".")
    try:
        return block.get_submodule(path)
    except AttributeError:
        pass
    try:
        parent = block.get_submodule(owner)
    except AttributeError:
        return None
    return parent._parameters.get(name, parent._buffers.get(name))


def tensor_ids(module: nn.Module) -> set[int]:
    """Ids of every parameter and buffer of ``module`` and its submodules."""
    return {id(t) for m in module.modules() for t in (*m._parameters.values(), *m._buffers.values()) if t is not None}


def kept_tensor_ids(block: nn.Module, paths: Sequence[str]) -> set[int]:
    """Ids of the tensors of ``block`` at ``paths`` (submodules, or single parameters and buffers), which stay
    resident: the model uses them outside the block (:attr:`gradseam.family.BlockList.called_outside`). A path the
    block lacks (a config leaves that submodule out) is skipped."""
    kept: set[int] = set()
    for path in paths:
        part = block_part(block, path)
        if isinstance(part, torch.Tensor):
            kept.add(id(part))
        elif part is not None:
            kept |= tensor_ids(part)
    return kept


class WeightStream:
    """The frozen weights of ``blocks`` (in forward order) kept in host memory and loaded per block.

    ``error(message)``: the exception raised for a streamed parameter that trains.
    ``test_mode``: a CPU model stands in for a GPU one (the loads are copies into fresh CPU tensors).
    ``prefetch``: how many blocks ahead of the running one are copied (0: each block when it runs).
    ``naive``: the reference the overlap is measured against (``gradseam bench``'s ``+ stream ... naive``
    rows), not a way to train: each block's weights are copied in on the compute stream when it runs, the
    host waiting, and copied back out when it is released, as ``block.to("cuda")`` / ``block.to("cpu")``
    around each use would; nothing is prefetched.
    ``keep``: per block, paths of submodules (or single tensors) that do not stream (the model uses them outside
    the block: :attr:`gradseam.family.BlockList.called_outside`); they stay where the model's tensors are.
    ``inherit``: the stream of the patch this one replaces (a second ``patch()`` of the model), unhooked: a block
    both stream is taken over with its host copies as they are (:meth:`_to_host`), so re-patching a model larger
    than its GPU never brings its weights back there, nor holds two host copies of them.
    ``lender``: the stream of a patch set aside while ``"auto"`` measures the model under patches of its own
    (:meth:`gradseam.handle.PatchHandle.set_aside`): a block both stream runs from the lender's host copies, which
    stay the lender's (:meth:`_borrow`). Without it, every measuring patch pinned and filled its own copies of
    the blocks it streamed, and :meth:`remove` made a third, pageable one: for the plan run on the whole model
    (Wan 2.1 14B), 26.8 GiB more pinned and as much again pageable, beside the lender's 26.8 GiB.
    """

    def __init__(self, blocks: Sequence[nn.Module], labels: Sequence[str], *,
                 error: Callable[[str], Exception], test_mode: bool = False, prefetch: int = 1,
                 naive: bool = False, keep: Sequence[Sequence[str]] = (), inherit: WeightStream | None = None,
                 lender: WeightStream | None = None) -> None:
        if prefetch < 0:
            raise ValueError(f"prefetch must be >= 0 blocks, got {prefetch}.")
        self.test_mode = test_mode
        self.prefetch = prefetch
        self.naive = naive
        self.copies_back = 0  # blocks copied back to host memory (the naive reference only)
        self._copy_stream: Any = None  # made at the first load on a GPU
        self.error = error
        self.blocks = [_Block(module, label, [], []) for module, label in zip(blocks, labels)]
        self.keep = [tuple(paths) for paths in keep] or [() for _ in self.blocks]
        self.inherit = inherit
        self.lender = lender
        self.device: torch.device | None = None  # where loads go: set from the model's resident tensors
        self.selected = False  # whether the frozen tensors were chosen and moved to host memory (select())
        self.loads = 0
        self.most_loaded = 0  # the most blocks loaded at once, for tests and the summary
        self._shared: set[int] = set()  # tensors a streamed block shares (tied weights): they stay (install())
        self._owned: dict[nn.Module, list[_Tensor]] = {}  # per module: the streamed tensors it holds
        self._hooks: list[Any] = []
        self._applies: list[nn.Module] = []
        self._end_queued = False
        # The order the blocks ran in, learnt from the last whole forward: prefetches and backward releases
        # follow it (a model may run its lists interleaved: Latte's spatial and temporal blocks alternate).
        self.order: list[int] = list(range(len(self.blocks)))
        self._position: dict[int, int] = {index: index for index in self.order}
        self._ran: list[int] = []  # the blocks the forward under way has run, in order
        self.misses = 0  # loads the compute stream waited for: not prefetched (the first block's aside)

    # -- host copies ---------------------------------------------------------------------------------

    def select(self) -> None:
        """Choose what streams, the frozen tensors of each block as they are now, and move them to host memory.

        Done once, as soon as the base is frozen: at patch time when it already is; else (a model patched
        as it loads, every parameter still trainable) at the model's first move to a GPU or its first
        forward, whichever comes first. A block with nothing frozen then is a full fine-tune: refused."""
        if self.selected:
            return
        for block in self.blocks:
            if not any(True for _ in streamable(block.module)):
                trainable = next((n for n, p in block.module.named_parameters() if p.requires_grad), None)
                raise self.error(
                    f"{block.label} has no frozen weight to stream: its parameters train ({block.label}.{trainable} "
                    "has requires_grad=True), and streamed weights are never copied back. Freeze the base before "
                    "the model moves to the GPU or runs (a LoRA trains beside the streamed weights, on the GPU), or "
                    "for a full fine-tune use an offload backend ('unsloth-compile', or 'unsloth' with "
                    "gradient_checkpointing_offload_attention) without streaming."
                )
        self.selected = True
        for block in self.blocks:
            self._to_host(block)
            for entry in block.tensors:
                owner = block.module.get_submodule(entry.name.rpartition(".")[0])
                self._owned.setdefault(owner, []).append(entry)

    def _to_host(self, block: _Block) -> None:
        found = [(path, t) for path, _, _, t in streamable(block.module) if id(t) not in self._shared]
        if self._take_over(block, {id(t) for _, t in found}) or self._borrow(block, {id(t) for _, t in found}):
            return
        hosts: dict[int, torch.Tensor] = {}
        buffers = []
        for dtype in dict.fromkeys(t.dtype for _, t in found):  # in the order they come
            of_dtype = [(i, t) for i, (_, t) in enumerate(found) if t.dtype == dtype]
            sizes = [-(-t.nbytes // ALIGN) * ALIGN for _, t in of_dtype]
            memory, pinned = self._allocate(sum(sizes)) if sum(sizes) else (pageable(0), False)
            offset = 0
            for (i, t), size in zip(of_dtype, sizes):
                hosts[i] = memory[offset:offset + t.nbytes].view(t.dtype).view(t.shape)
                hosts[i].copy_(t.data)
                offset += size
            buffers.append(_Buffer(memory, pinned, sum(sizes)))
        tensors = [_Tensor(path, t, hosts[i], t.device) for i, (path, t) in enumerate(found)]
        for entry in tensors:
            entry.tensor.data = entry.host  # the device storage goes when nothing else holds it
        block.tensors, block.buffers = tensors, buffers

    def _take_over(self, block: _Block, ids: set[int]) -> bool:
        """Take ``block``'s host copies from the stream this one replaces (``inherit``) when it streamed the same
        tensors of the same module and they point at those copies now (parked): no copy, no second buffer. The
        inherited stream keeps nothing of the block, so its ``remove()`` leaves it alone."""
        old = _parked(self.inherit, block, ids)
        if old is None:
            return False
        block.tensors, block.buffers = old.tensors, old.buffers
        old.tensors, old.buffers = [], []
        return True

    def _borrow(self, block: _Block, ids: set[int]) -> bool:
        """Run ``block`` from the lender's host copies, on the same terms as :meth:`_take_over`: no buffer, no copy.
        The lender keeps them: :meth:`remove` parks them again instead of putting them anywhere."""
        old = _parked(self.lender, block, ids)
        if old is None:
            return False
        block.tensors, block.buffers, block.borrowed = list(old.tensors), [], True
        return True

    @contextmanager
    def lent(self, modules: set[int]) -> Iterator[list[int]]:
        """Inside, the blocks whose module's id is in ``modules`` are on the device, as if resident; parked again on
        exit. Yields their indices. (The caller leaves out the blocks a measuring patch streams: that one loads them.)

        Why: ``"auto"`` measures a model larger than its GPU (every block's weights in host memory since patch time,
        this stream set aside) under patches of its own, and a candidate that keeps a block's weights resident must
        find them on the GPU. They are loaded before the measured step starts, so the measurement counts them as
        what is allocated before it (the planner counts each resident block's weights apart), and only the blocks of
        the model cut to the measured depth are loaded (``modules``: what the cut model holds)."""
        chosen = [index for index, block in enumerate(self.blocks)
                  if id(block.module) in modules and block.tensors and not block.loaded]
        try:
            for index in chosen:
                self.load(index, count=False)
            yield chosen
        finally:
            for index in chosen:
                self.release(index)

    def _allocate(self, nbytes: int) -> tuple[torch.Tensor, bool]:
        if self.test_mode or not torch.cuda.is_available():
            return pageable(nbytes), False
        try:
            return register_pinned(nbytes), True
        except RuntimeError as exc:
            _warn_once(f"gradseam: could not pin {nbytes / 2**30:.2f} GiB of host memory for streamed weights "
                       f"({exc}); they stay in pageable memory, so each copy to the GPU is slower. Free host memory "
                       "or stream fewer blocks.")
            return pageable(-(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE), False

    @property
    def host_bytes(self) -> int:
        return sum(b.nbytes for b in self.blocks)

    @property
    def pinned_bytes(self) -> int:
        return sum(b.pinned_bytes for b in self.blocks)

    # -- loads and releases ----------------------------------------------------------------------------

    def _target(self) -> torch.device | None:
        """Where a load copies to; None when the model runs on the CPU for real (nothing to stream to)."""
        if self.test_mode:
            return torch.device("cpu")
        if self.device is None or self.device.type == "cpu":
            return None
        return self.device

    def load(self, index: int, *, ahead: bool = False, count: bool = True) -> None:
        """Bring block ``index``'s streamed tensors to the device. ``ahead``: a prefetch, whose copy may still
        run when this returns; without it the compute stream waits for the copy (issued now or before). ``count``:
        a load of the training's (the summary's counts); not one lent for a measurement (:meth:`lent`)."""
        self.select()
        block = self.blocks[index]
        if block.loaded:
            if not ahead:
                self._wait(block)
            return
        if not ahead and count:
            self.misses += 1
        for entry in block.tensors:
            if isinstance(entry.tensor, nn.Parameter) and entry.tensor.requires_grad:
                raise self.error(
                    f"{block.label}.{entry.name} trains now (requires_grad=True), but its weights stream from host "
                    "memory, and streamed weights are never copied back. Freeze it, or patch again after choosing "
                    "what trains (a streamed block's trainable parameters stay on the GPU)."
                )
        target = self._target()
        if target is None:
            return
        streamed = {id(e.tensor) for e in block.tensors}
        for name, p in block.module.named_parameters():
            if id(p) not in streamed and p.device != target and not self.test_mode:
                raise self.error(
                    f"{block.label}.{name} is on {p.device}, and the block computes on {target}: a parameter added "
                    "to a streamed block after its weights went to host memory (a LoRA added after patching) is "
                    "made where they are. Call model.to(...) once more after adding it; the streamed weights stay "
                    "in host memory."
                )
        if self.test_mode:
            for entry in block.tensors:
                entry.tensor.data = entry.host.clone()
        elif self.naive:
            for entry in block.tensors:  # on the compute stream; the host waits for each copy
                entry.tensor.data = entry.host.to(target)
        else:
            compute = torch.cuda.current_stream(target)
            # allocated from the compute stream's pool: released, the memory goes back to compute-stream work
            copies = [torch.empty_like(entry.host, device=target) for entry in block.tensors]
            if self._copy_stream is None:
                self._copy_stream = torch.cuda.Stream(target)
                if not expandable_segments():
                    _warn_once(FRAGMENTATION)
            self._copy_stream.wait_stream(compute)  # kernels still queued may use memory the allocator just reused
            with torch.cuda.stream(self._copy_stream):
                for copy, entry in zip(copies, block.tensors):
                    copy.copy_(entry.host, non_blocking=True)
                block.copied = torch.cuda.Event()
                block.copied.record(self._copy_stream)
            for copy, entry in zip(copies, block.tensors):
                entry.tensor.data = copy
            if not ahead:
                self._wait(block)
        block.loaded = True
        if count:
            self.loads += 1
            self.most_loaded = max(self.most_loaded, sum(b.loaded for b in self.blocks))

    @property
    def ahead(self) -> int:
        """How many blocks are copied ahead of the running one: none in the naive reference."""
        return 0 if self.naive else self.prefetch

    def prefetch_after(self, index: int, step: int) -> None:
        """Copy the ``prefetch`` blocks that run after block ``index`` (``step`` 1 in forward, -1 in backward), in
        the order the blocks ran last (:attr:`order`)."""
        at = self._position[index]
        for ahead in range(1, self.ahead + 1):
            nxt = at + step * ahead
            if 0 <= nxt < len(self.order):
                self.load(self.order[nxt], ahead=True)

    def _learn_order(self) -> None:
        """After a forward: the order its blocks ran in becomes :attr:`order` (blocks that did not run keep
        their places after the ones that did). A block that ran twice counts where it ran first."""
        ran = list(dict.fromkeys(self._ran))
        self._ran = []
        if not ran or ran == self.order[:len(ran)]:
            return
        order = ran + [index for index in self.order if index not in set(ran)]
        self.order, self._position = order, {index: at for at, index in enumerate(order)}

    def _wait(self, block: _Block) -> None:
        """The compute stream waits (on the GPU, not the host) for ``block``'s copy, once."""
        if block.copied is not None:
            torch.cuda.current_stream(self._target()).wait_event(block.copied)
            block.copied = None

    def release(self, index: int) -> None:
        block = self.blocks[index]
        if not block.loaded:
            return
        self._wait(block)  # a prefetch never waited for: its copy must finish before the memory is reused
        if self.naive:  # the reference copies both ways, as moving the block out would; the values are the same
            for entry in block.tensors:
                entry.host.copy_(entry.tensor.data)
            self.copies_back += 1
        for entry in block.tensors:
            entry.tensor.data = entry.host
        block.loaded = False

    def release_all(self) -> None:
        self._end_queued = False
        for index in range(len(self.blocks)):
            self.release(index)

    # -- hooks -------------------------------------------------------------------------------------------

    def install(self, model: nn.Module) -> None:
        """Hook every streamed block, keep its streamed tensors in host memory through ``model.to()``, and
        select them now if the base is frozen already (:meth:`select`)."""
        self.device = _resident_device(model, {id(e.tensor) for block in self.blocks for e in block.tensors})
        self._shared = _shared_tensors(model, [block.module for block in self.blocks]) | self._kept()
        self._hooks.append(model.register_forward_pre_hook(self._model_pre))
        self._hooks.append(model.register_forward_hook(self._model_post))
        for index, block in enumerate(self.blocks):
            # partials of bound methods, not closures: copy.deepcopy and pickling of the model carry them over with
            # their stream (a closure would be shared by the copy, which would then load the original's blocks)
            self._hooks.append(block.module.register_forward_pre_hook(functools.partial(self._pre, index)))
            self._hooks.append(block.module.register_forward_hook(functools.partial(self._post, index),
                                                                  always_call=True))
            for module in block.module.modules():
                if "_apply" not in module.__dict__:  # a module in two streamed blocks is wrapped once
                    module._apply = _KeepingHost(module, self)
                    self._applies.append(module)
        if any(True for block in self.blocks for _ in streamable(block.module)):
            self.select()

    def _kept(self) -> set[int]:
        """Ids of the tensors each block's ``keep`` paths name (one a config leaves out is skipped)."""
        return set().union(*(kept_tensor_ids(block.module, paths) for block, paths in zip(self.blocks, self.keep)))

    def _model_pre(self, module: nn.Module, args: tuple) -> None:
        """A step starts: nothing of the last one stays loaded, and the first streamed block's copy starts now,
        overlapping whatever runs before it (the embeddings, the resident blocks in front of it).

        Nothing once unhooked: torch reads a forward's pre-hooks before running the first, so a stream unhooked by
        an earlier one (``"auto"`` installing its plan in its own pre-hook, the stream it replaces unhooked and
        removed there) is still called for that forward. Its prefetch would start a copy into a parameter that no
        hook then waits for, and the block's first kernels could read it half-copied."""
        if torch._C._current_graph_task_id() != -1 or not self.blocks or not self._hooks:
            return
        self.release_all()
        self._ran = []
        if self.ahead:
            self.load(self.order[0], ahead=True)

    def _model_post(self, module: nn.Module, args: tuple, output: Any) -> None:
        """Forward is done: the last streamed block's backward comes first, so its copy starts now and overlaps
        the loss and the backward of the blocks after it, instead of being waited for when its gradient comes."""
        if torch._C._current_graph_task_id() != -1 or not self.blocks or not self._hooks:
            return
        self._learn_order()
        if self.ahead and torch.is_grad_enabled() and any(t.requires_grad for t in _tensors(output)):
            self.load(self.order[-1], ahead=True)

    def _pre(self, index: int, module: nn.Module, args: tuple) -> None:
        self.load(index)
        if torch._C._current_graph_task_id() == -1:  # a recompute inside backward prefetches from the hook
            self._ran.append(index)
            self.prefetch_after(index, 1)

    def _post(self, index: int, module: nn.Module, args: tuple, output: Any) -> None:
        if torch._C._current_graph_task_id() != -1:
            return  # a forward run inside backward (a recompute): its backward comes next, keep the weights
        if torch.is_grad_enabled():
            for t in _tensors(output):
                if t.requires_grad:
                    t.register_hook(self._before_backward(index))
        self.release(index)

    def _before_backward(self, index: int) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            for later in self.order[self._position[index] + 1:]:
                self.release(later)  # their backward has run: this block's output gradient came from it
            self.load(index)
            self.prefetch_after(index, -1)
            if not self._end_queued:
                self._end_queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self.release_all)
        return hook

    def __getstate__(self) -> dict[str, Any]:
        """What ``copy.deepcopy`` and pickling of the model carry over (the hooks and each module's ``_apply`` guard
        hold this stream, so they copy it with the model): everything but the CUDA copy stream and its events, and
        the stream this one replaced. The copied host copies are plain memory, not pinned (nothing registered
        them), so the copy neither unregisters them nor counts them pinned."""
        state = self.__dict__.copy()
        state["_copy_stream"] = None
        state["inherit"] = None
        # the host copies keep their memory alive; the raw byte buffer is dropped (the copy never unregisters it, and
        # torch.save refuses one storage seen as bytes and as the copies' dtypes)
        state["blocks"] = [_Block(b.module, b.label, b.tensors, [_Buffer(None, False, x.nbytes) for x in b.buffers],
                                  b.loaded) for b in self.blocks]
        return state

    def unhook(self) -> None:
        """Take the hooks off (and ``model.to()``'s guard), leaving every streamed tensor in host memory: the
        model then runs as if these blocks' weights were never streamed, which on a GPU means it cannot run them
        until they are hooked again (:meth:`install`) or put back (:meth:`remove`)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        for owner in self._applies:
            owner.__dict__.pop("_apply", None)
        self._applies.clear()
        self.park()

    def park(self) -> None:
        """Every streamed tensor points at its host copy again, whatever pointed it elsewhere meanwhile (a
        stream of a measurement's patch, which put the blocks it streamed back on the GPU when removed)."""
        for index, block in enumerate(self.blocks):
            self.release(index)
            for entry in block.tensors:
                entry.tensor.data = entry.host

    def remove(self) -> None:
        """Put every streamed tensor back where it was when streaming began, or where the model moved since (a
        model patched on the CPU and moved to a GPU gets its weights on the GPU), and free the host memory."""
        # Every copy is made before anything changes: out of memory half-way (a GPU still full of a failed step's
        # activations), the stream stays as it was, working, and remove() can be called again. Where to: where the
        # tensor was, not where the model computes (a measuring patch of "auto" streams weights that the set-aside
        # stream keeps in host memory; bringing them to the GPU ran out of memory on Wan 2.1 14B at 24 GiB).
        try:
            copies = [[] if block.borrowed else [entry.host.to(entry.home, copy=True) for entry in block.tensors]
                      for block in self.blocks]
        except torch.OutOfMemoryError as exc:
            total = sum(e.host.nbytes for b in self.blocks for e in b.tensors) / 2**30
            raise torch.OutOfMemoryError(
                f"gradseam: remove() could not bring the streamed weights ({total:.2f} GiB) back where the model "
                f"keeps them ({exc}). Nothing changed: the weights still stream. Free GPU memory (drop the last "
                "step's outputs, and an exception caught from it, which holds its activations) and call remove() "
                "again, or move the model to the CPU first.") from exc
        self.unhook()
        for index, (block, restored) in enumerate(zip(self.blocks, copies)):
            self.release(index)
            if block.borrowed:  # the lender's: parked again, in its host copies
                for entry in block.tensors:
                    entry.tensor.data = entry.host
                block.tensors = []
                continue
            for entry, copy in zip(block.tensors, restored):
                entry.tensor.data = copy
            if any(buffer.pinned for buffer in block.buffers) and torch.cuda.is_initialized():
                torch.cuda.synchronize()  # no copy out of a buffer is still in flight
            for buffer in block.buffers:
                if buffer.pinned and buffer.memory is not None:
                    unregister_pinned(buffer.memory)
            block.buffers = []


def _parked(source: WeightStream | None, block: _Block, ids: set[int]) -> _Block | None:
    """``source``'s block of the same module, where it streams exactly the tensors ``ids`` and each points at its host
    copy now (parked); else None."""
    old = next((b for b in source.blocks if b.module is block.module), None) if source is not None else None
    if old is None or not old.tensors or {id(e.tensor) for e in old.tensors} != ids \
            or any(e.tensor.data.data_ptr() != e.host.data_ptr() for e in old.tensors):
        return None
    return old


def _tensors(value: Any) -> list[torch.Tensor]:
    from torch.utils._pytree import tree_leaves

    return [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]


def _shared_tensors(model: nn.Module, blocks: list[nn.Module]) -> set[int]:
    """Ids of the tensors a streamed block holds together with another block or with a module outside them
    (tied weights): moving one holder's ``.data`` would move it under the others."""
    inside = {id(m) for block in blocks for m in block.modules()}
    outside = {id(t) for m in model.modules() if id(m) not in inside
               for t in (*m._parameters.values(), *m._buffers.values()) if t is not None}
    seen: set[int] = set()
    twice: set[int] = set()
    for block in blocks:
        ids = tensor_ids(block)
        twice |= seen & ids
        seen |= ids
    return outside | twice


def _resident_device(model: nn.Module, streamed: set[int] | None = None) -> torch.device:
    """Where the model's blocks compute: the device of its first tensor that does not stream (hooked again after
    the model moved, the streamed ones are in host memory)."""
    return next((t.device for t in (*model.parameters(), *model.buffers()) if id(t) not in (streamed or ())),
                torch.device("cpu"))


class _KeepingHost:
    """``module._apply`` that leaves the module's streamed tensors in host memory: they are taken out of the
    module for the call (and put back in their places, so the order of ``state_dict()`` keys stays), and the
    device ``fn`` moves tensors to becomes the stream's device. A first move to a GPU selects what streams
    (:meth:`WeightStream.select`) before anything moves; ``fn`` changing a streamed dtype is refused first.
    An object holding its module and stream (not a closure), so a copy of the model guards its own tensors."""

    def __init__(self, module: nn.Module, stream: WeightStream) -> None:
        self.module, self.stream = module, stream

    def __call__(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Any:
        module, owner = self.module, self.stream
        if not owner.selected and fn(torch.empty(0)).device.type != "cpu":
            owner.select()
        entries = owner._owned.get(module, [])
        for entry in entries:
            # the probe starts where the module's tensors would be had they not streamed: fn of .to(dtype) keeps a
            # tensor's device, and a probe on the CPU read as a move there stopped every load
            probe = fn(torch.empty(0, dtype=entry.host.dtype, device=entry.home))
            if probe.dtype != entry.host.dtype:
                raise TypeError(
                    f"gradseam: {type(module).__name__}.{entry.name.rsplit('.', 1)[-1]} streams from host memory in "
                    f"{entry.host.dtype}; changing it to {probe.dtype} after patching is not supported. Change the "
                    "model's dtype before patching."
                )
            owner.device = entry.home = probe.device  # where the model's other tensors go: the loads follow
        held = {}
        for kind in ("_parameters", "_buffers"):
            table = getattr(module, kind)
            order = list(table)
            taken = {k: table.pop(k) for k in order if any(table.get(k) is e.tensor for e in entries)}
            held[kind] = (order, taken)
        try:
            return type(module)._apply(module, fn, recurse)  # the class's own: the guard is set only where none was
        finally:
            for kind, (order, taken) in held.items():
                table = getattr(module, kind)
                rebuilt = {k: taken[k] if k in taken else table[k] for k in order}
                table.clear()
                table.update(rebuilt)
