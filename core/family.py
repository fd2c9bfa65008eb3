"""What an adapter declares about a model family: plain data, no behaviour.

This module and :mod:`gradseam.hookspecs` are the only parts of the core an adapter imports.
Classes are named by their qualified name (``"diffusers.models....FluxTransformer2DModel"``)
so an adapter can describe a class before the installed diffusers has it, and so that listing
families never imports diffusers model modules. A bare class name without a module
(``"MageFlowTransformer2DModel"``) matches a class of that name from any module, for classes
whose upstream home is not settled yet.
"""

from __future__ import annotations

import keyword
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

ClassRef = str | type


def class_name(ref: ClassRef) -> str:
    """The qualified name used everywhere a class is matched."""
    if isinstance(ref, str):
        return ref
    return f"{ref.__module__}.{ref.__qualname__}"


def bare_name(ref: ClassRef) -> str:
    """The class's own name, the part a bare-name declaration and a full one share."""
    return class_name(ref).rsplit(".", 1)[-1]


# -- validation ----------------------------------------------------------------------------------
# The declarations are read long after they are written (at patch time, in `gradseam families`), so a
# wrong type must fail here, where the plugin author wrote it: a string where a tuple belongs would
# otherwise be iterated as its characters and surface later as a baffling "no module 'f'".

_FAMILY_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
_SEQUENCES = (tuple, list)  # ordered; a set would make the order of lists and seams arbitrary


def _show(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 80 else text[:77] + '...'}"


def _identifier(part: str) -> bool:
    return part.isidentifier() and not keyword.iskeyword(part)


def _is_path(value: Any) -> bool:
    # attribute paths may step through a ModuleList by index ("blocks.0.attn")
    return isinstance(value, str) and all(_identifier(p) or p.isdigit() for p in value.split("."))


def _is_class_name(value: Any) -> bool:
    return isinstance(value, str) and all(_identifier(p) or p == "<locals>" for p in value.split("."))


def _type_error(owner: str, name: str, expected: str, value: Any, example: str) -> TypeError:
    """``example`` shows the right form, with ``{v}`` standing for the string the author wrote."""
    hint = ""
    if isinstance(value, str):
        hint = f" A string here would be read as its characters: write {example.format(v=repr(value))}."
    return TypeError(f"{owner}: field {name!r} must be {expected}, got {_show(value)}.{hint}")


def _sequence(owner: str, name: str, value: Any, expected: str, example: str) -> tuple[Any, ...]:
    if not isinstance(value, _SEQUENCES):
        raise _type_error(owner, name, expected, value, example)
    return tuple(value)


def _paths(owner: str, name: str, value: Any, expected: str, example: str) -> tuple[str, ...]:
    items = _sequence(owner, name, value, expected, example)
    for item in items:
        if not isinstance(item, str):
            raise TypeError(f"{owner}: field {name!r} must be {expected}, got {_show(value)} (item {_show(item)}).")
        if not _is_path(item):
            raise ValueError(
                f"{owner}: field {name!r} holds {item!r}, which is not a submodule path "
                "(attribute names separated by dots, e.g. 'ff' or 'attn.to_out.0')."
            )
    return items


@dataclass(frozen=True)
class Carry:
    """How a block's output feeds the next block of the same list (needed for interval chunks).

    ``outputs`` maps a parameter name of the block's ``forward`` to the position of that value in
    the block's return value, or to ``None`` when the block returns that single tensor. Flux's
    double block returns ``(encoder_hidden_states, hidden_states)``, so it declares
    ``{"encoder_hidden_states": 0, "hidden_states": 1}``; Wan's block returns ``hidden_states``,
    so ``{"hidden_states": None}``. Every other argument must be passed unchanged along the list.
    """

    outputs: Mapping[str, int | None]

    def __post_init__(self) -> None:
        owner = "Carry"
        outputs = self.outputs
        if not isinstance(outputs, Mapping):
            raise TypeError(
                f"{owner}: field 'outputs' must be a mapping of the block's forward parameter names to "
                f"positions in its return value (int >= 0, or None for a block returning one tensor), "
                f"got {_show(outputs)}; e.g. Carry({{'hidden_states': None}})."
            )
        if not outputs:
            raise ValueError(f"{owner}: field 'outputs' is empty; name the parameter(s) each block hands to the next.")
        for name, position in outputs.items():
            if not isinstance(name, str):
                raise TypeError(f"{owner}: field 'outputs' keys must be parameter names (str), got {_show(name)}.")
            if not _identifier(name):
                raise ValueError(f"{owner}: field 'outputs' key {name!r} is not a parameter name.")
            if position is not None and (isinstance(position, bool) or not isinstance(position, int)):
                raise TypeError(
                    f"{owner}: field 'outputs' maps {name!r} to {_show(position)}; expected a position "
                    "in the block's returned tuple (int >= 0), or None when the block returns that one tensor."
                )
            if position is not None and position < 0:
                raise ValueError(
                    f"{owner}: field 'outputs' maps {name!r} to {position}; positions count from 0 "
                    "(negative indices would silently follow the length of the returned tuple)."
                )
        single = [name for name, position in outputs.items() if position is None]
        if single and len(outputs) > 1:
            raise ValueError(
                f"{owner}: field 'outputs' maps {single[0]!r} to None (the block returns that one tensor), "
                f"so it cannot also carry {sorted(set(outputs) - {single[0]})}; use tuple positions instead."
            )
        # a private copy: mutating the caller's dict later must not change a registered family
        object.__setattr__(self, "outputs", dict(outputs))


@dataclass(frozen=True)
class BlockList:
    """One ``nn.ModuleList`` of transformer blocks, found by attribute path on the model.

    ``per_block`` names the arguments through which the model's loop hands each block a state
    object of its own, typically one layer of a KV cache that the attention writes to (extract
    mode) or reads from (cached mode). An interval chunk runs its later blocks ahead with the first
    block's arguments, so it would hand them the first block's state: they would write their K/V
    into its cache, a side effect no fall-back can undo. Whenever the first block's call has a
    non-None value there, the chunk therefore computes block by block. A name is a parameter of the
    block's ``forward`` (``"layer_cache"``); a dotted name follows keys of a dict argument, or
    attributes of another object (``"joint_attention_kwargs.kv_cache"``: Flux 2's loop puts each
    block's cache into the kwargs dict).

    ``called_outside`` names the submodules of a block that the model calls outside that block's own
    forward, as ``(index, path)`` pairs: DiT's forward calls ``transformer_blocks[0].norm1.emb`` again
    after the loop, for the final layer's modulation (``(0, "norm1.emb")``; a negative index counts from
    the end). A path may also name one parameter or buffer the model reads itself (``(1,
    "scale_shift_table")``). Weight streaming keeps their weights on the GPU when it streams that block:
    streamed, they would be in host memory when the call comes. The conformance kit watches every block
    submodule's calls, and every read of a block's tensors in the model's forward, and fails a family that
    leaves one out.
    """

    path: str
    carry: Carry | None = None  # None: blocks of this list cannot be chunked (interval is ignored)
    optional: bool = False  # the attribute may be missing or None in some configs
    per_block: tuple[str, ...] = ()  # arguments carrying each block's own state (see above)
    called_outside: tuple[tuple[int, str], ...] = ()  # (block index, submodule or tensor path) used outside it

    def __post_init__(self) -> None:
        owner = f"BlockList({self.path!r})" if isinstance(self.path, str) else "BlockList"
        if not isinstance(self.path, str):
            raise TypeError(f"{owner}: field 'path' must be an attribute path (str), got {_show(self.path)}.")
        if not _is_path(self.path):
            raise ValueError(
                f"{owner}: field 'path' is not an attribute path (attribute names separated by dots, "
                "e.g. 'transformer_blocks' or 'text_fusion.layerwise_blocks')."
            )
        if self.carry is not None and not isinstance(self.carry, Carry):
            wrap = f" Wrap it: carry=Carry({self.carry!r})." if isinstance(self.carry, Mapping) else ""
            raise TypeError(f"{owner}: field 'carry' must be a Carry or None, got {_show(self.carry)}.{wrap}")
        if not isinstance(self.optional, bool):
            raise TypeError(f"{owner}: field 'optional' must be True or False, got {_show(self.optional)}.")
        object.__setattr__(self, "per_block", self._per_block(owner))
        object.__setattr__(self, "called_outside", self._called_outside(owner))

    def _called_outside(self, owner: str) -> tuple[tuple[int, str], ...]:
        expected = "a tuple of (block index, submodule path) pairs, e.g. ((0, 'norm1.emb'),)"
        pairs = _sequence(owner, "called_outside", self.called_outside, expected, "((0, {v}),)")
        for pair in pairs:
            if not (isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], int)
                    and not isinstance(pair[0], bool) and _is_path(pair[1])):
                raise TypeError(f"{owner}: field 'called_outside' must be {expected}, got {_show(self.called_outside)} "
                                f"(item {_show(pair)}).")
        if len(set(pairs)) != len(pairs):
            raise ValueError(f"{owner}: field 'called_outside' names a submodule twice: {pairs!r}.")
        return tuple(pairs)

    def outside(self, index: int, length: int) -> tuple[str, ...]:
        """The submodule and tensor paths of block ``index`` (of ``length`` in the list) the model uses outside it."""
        return tuple(path for at, path in self.called_outside if at == index or at + length == index)

    def _per_block(self, owner: str) -> tuple[str, ...]:
        expected = "a tuple of argument names (a dotted name reaches into a dict argument)"
        names = _sequence(owner, "per_block", self.per_block, expected, "({v},)")
        carried = set(self.carry.outputs) if self.carry is not None else set()
        seen: set[str] = set()
        for name in names:
            if not isinstance(name, str):
                raise TypeError(
                    f"{owner}: field 'per_block' must be {expected}, got {_show(self.per_block)} (item {_show(name)})."
                )
            if not all(_identifier(part) for part in name.split(".")):
                raise ValueError(
                    f"{owner}: field 'per_block' holds {name!r}, which is not an argument name: a parameter of the "
                    "block's forward, then optionally dict keys separated by dots (e.g. 'layer_cache' or "
                    "'joint_attention_kwargs.kv_cache')."
                )
            if name in seen:
                raise ValueError(f"{owner}: field 'per_block' names {name!r} twice.")
            seen.add(name)
            if name.split(".", 1)[0] in carried:
                raise ValueError(
                    f"{owner}: field 'per_block' names {name!r}, which the carry hands from each block to the "
                    "next; a per-block state is what the model's loop passes each block, not a block's output."
                )
        return names


@dataclass(frozen=True)
class BlockClass:
    """The safe cuts inside one block class.

    ``ffn``: the feed-forward side as one or more *seams*. A seam is a tuple of submodule paths
    that the block calls in sequence, each on exactly the previous one's output (``("ff",)``, or
    ``("proj_mlp", "act_mlp")`` for a block whose MLP has no module of its own); gradseam runs a
    whole seam as one checkpoint region. Empty means the block has no safe FFN boundary and the
    ``-ffn`` backends refuse it.

    ``attention``: the submodules that make up the attention side (their saved tensors are what
    attention offload moves to the CPU). Empty means attention offload is refused.

    ``optional``: submodule paths (of ``ffn`` or ``attention``) that some instances of the class
    lack (the attribute is missing or None). SD3's last joint block is built without ``ff_context``:
    declared optional, that seam is simply absent from that one block instead of the whole family
    giving up the ``-ffn`` backends. A path not listed here must exist on every instance.
    """

    cls: ClassRef
    ffn: tuple[tuple[str, ...], ...] = ()
    attention: tuple[str, ...] = ()
    optional: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not (isinstance(self.cls, type) or _is_class_name(self.cls)):
            error = ValueError if isinstance(self.cls, str) else TypeError
            raise error(
                "BlockClass: field 'cls' must be a class or its qualified name (e.g. "
                f"'diffusers.models.attention.JointTransformerBlock'), got {_show(self.cls)}."
            )
        owner = f"BlockClass({bare_name(self.cls)!r})"
        expected = "a tuple of seams, each a tuple of submodule paths"
        seams = _sequence(owner, "ffn", self.ffn, expected, "(({v},),)")
        ffn = []
        for seam in seams:
            if not isinstance(seam, _SEQUENCES):
                example = f"(({seam!r},),)" if isinstance(seam, str) else '(("ff",),)'
                raise TypeError(
                    f"{owner}: field 'ffn' must be {expected}, got {_show(self.ffn)} (item {_show(seam)}); "
                    f"one seam of one module is written {example}."
                )
            if not seam:
                raise ValueError(f"{owner}: field 'ffn' holds an empty seam; a seam names at least one submodule.")
            ffn.append(_paths(owner, "ffn", seam, expected, "(({v},),)"))
        seen: set[str] = set()
        for path in (p for seam in ffn for p in seam):
            if path in seen:
                raise ValueError(
                    f"{owner}: field 'ffn' names {path!r} twice; a submodule belongs to one seam at most "
                    "(it would be checkpointed inside its own checkpoint)."
                )
            seen.add(path)
        attention = _paths(owner, "attention", self.attention, "a tuple of submodule paths", "({v},)")
        optional = _paths(owner, "optional", self.optional, "a tuple of submodule paths", "({v},)")
        declared = seen | set(attention)
        for path in optional:
            if path not in declared:
                raise ValueError(
                    f"{owner}: field 'optional' names {path!r}, which is neither in 'ffn' nor in 'attention'; "
                    "only a declared submodule can be optional."
                )
        object.__setattr__(self, "ffn", tuple(ffn))
        object.__setattr__(self, "attention", attention)
        object.__setattr__(self, "optional", optional)

    @property
    def name(self) -> str:
        return class_name(self.cls)


@dataclass(frozen=True)
class Preset:
    """A real-size architecture config (constructor kwargs) for benchmarks; weights are never downloaded.

    ``make_inputs(model, device, dtype, tokens, **inputs)`` builds one real-size batch of forward
    keyword arguments for ``model`` (built from ``config``, possibly with truncated block lists)
    directly on ``device``: floating inputs in ``dtype``, the latents requiring grad. ``tokens``
    overrides the preset's image (or video) token count, approximately; None keeps the preset's.
    The preset's ``inputs`` are passed as keyword arguments, so they stay the one source of the sizes.
    """

    description: str
    config: Mapping[str, Any]
    inputs: Mapping[str, Any] = field(default_factory=dict)
    make_inputs: Callable[..., Mapping[str, Any]] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.description, str):
            raise TypeError(f"Preset: field 'description' must be a str, got {_show(self.description)}.")
        owner = f"Preset({self.description!r})"
        for name in ("config", "inputs"):
            value = getattr(self, name)
            if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
                raise TypeError(
                    f"{owner}: field {name!r} must be a mapping of keyword-argument names (str) to values, "
                    f"got {_show(value)}."
                )
            object.__setattr__(self, name, dict(value))
        if self.make_inputs is not None and not callable(self.make_inputs):
            raise TypeError(f"{owner}: field 'make_inputs' must be a function or None, got {_show(self.make_inputs)}.")


@dataclass(frozen=True)
class Family:
    """Everything gradseam needs to patch one model family."""

    name: str
    models: tuple[ClassRef, ...]
    block_lists: tuple[BlockList, ...]
    block_classes: tuple[BlockClass, ...]
    description: str = ""
    presets: Mapping[str, Preset] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise TypeError(f"Family: field 'name' must be a str, got {_show(self.name)}.")
        if not _FAMILY_NAME.fullmatch(self.name):
            raise ValueError(
                f"Family: field 'name' is {self.name!r}; a family name is what `gradseam bench --family` "
                "takes: letters, digits, '_', '-' and '.', starting with a letter or digit."
            )
        owner = f"Family {self.name!r}"
        models = _sequence(owner, "models", self.models, "a tuple of model classes or their qualified names",
                           "({v},)")
        for ref in models:
            if not (isinstance(ref, type) or _is_class_name(ref)):
                raise (ValueError if isinstance(ref, str) else TypeError)(
                    f"{owner}: field 'models' must hold classes or qualified class names, got {_show(ref)}."
                )
        self._no_duplicates(owner, "models", [class_name(m) for m in models], "model class")
        block_lists = _sequence(owner, "block_lists", self.block_lists, "a tuple of BlockList",
                                "(BlockList({v}),)")
        self._all_of(owner, "block_lists", block_lists, BlockList)
        self._no_duplicates(owner, "block_lists", [bl.path for bl in block_lists], "path")
        block_classes = _sequence(owner, "block_classes", self.block_classes, "a tuple of BlockClass",
                                  "(BlockClass(...),)")
        self._all_of(owner, "block_classes", block_classes, BlockClass)
        self._no_duplicates(owner, "block_classes", [bc.name for bc in block_classes], "class")
        for name, items in (("models", models), ("block_lists", block_lists), ("block_classes", block_classes)):
            if not items:
                raise ValueError(f"{owner}: field {name!r} is empty; a family needs at least one.")
        if not isinstance(self.description, str):
            raise TypeError(f"{owner}: field 'description' must be a str, got {_show(self.description)}.")
        if not isinstance(self.presets, Mapping):
            raise TypeError(f"{owner}: field 'presets' must be a mapping of names to Preset, got {_show(self.presets)}.")
        for key, preset in self.presets.items():
            if not isinstance(key, str) or not key:
                raise TypeError(f"{owner}: field 'presets' keys must be non-empty names (str), got {_show(key)}.")
            if not isinstance(preset, Preset):
                raise TypeError(f"{owner}: field 'presets' maps {key!r} to {_show(preset)}; expected a Preset.")
        set_ = object.__setattr__
        set_(self, "models", models)
        set_(self, "block_lists", block_lists)
        set_(self, "block_classes", block_classes)
        set_(self, "presets", dict(self.presets))

    @staticmethod
    def _all_of(owner: str, name: str, items: tuple[Any, ...], kind: type) -> None:
        for item in items:
            if not isinstance(item, kind):
                raise TypeError(f"{owner}: field {name!r} must hold {kind.__name__} objects, got {_show(item)}.")

    @staticmethod
    def _no_duplicates(owner: str, name: str, keys: list[str], what: str) -> None:
        seen: set[str] = set()
        for key in keys:
            if key in seen:
                raise ValueError(f"{owner}: field {name!r} declares {what} {key!r} twice.")
            seen.add(key)

    @property
    def model_names(self) -> tuple[str, ...]:
        return tuple(class_name(m) for m in self.models)

    @property
    def has_ffn(self) -> bool:
        return bool(self.block_classes) and all(bc.ffn for bc in self.block_classes)

    @property
    def has_attention(self) -> bool:
        return bool(self.block_classes) and all(bc.attention for bc in self.block_classes)

    @property
    def supports_interval(self) -> bool:
        return any(bl.carry is not None for bl in self.block_lists)

    def block_class_for(self, module_type: type) -> BlockClass | None:
        """The declaration matching a block's class, looking through subclasses' MRO."""
        by_name = {bc.name: bc for bc in self.block_classes}
        for klass in module_type.__mro__:
            found = by_name.get(class_name(klass)) or by_name.get(klass.__qualname__)
            if found is not None:
                return found
        return None
