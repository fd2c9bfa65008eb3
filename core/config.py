"""The user-facing configuration: the keys trainers already write, validated strictly.

Users copy these keys between trainers, JSON files and notebooks, so the names are fixed and
every mistake must be caught here, before a long job starts, with a message that names the key,
shows the bad value and says what would have been accepted.
"""

from __future__ import annotations

import contextlib
import difflib
import json
import os
import re
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from .backends import CATALOG
from .errors import ConfigFileNotFoundError, warn_once

BACKENDS: tuple[str, ...] = tuple(CATALOG)
DEFAULT_BACKEND = "torch"  # what a left-out gradient_checkpointing_backend reads as
AUTO = "auto"  # not a backend: each block's backend and settings planned at the first training step (gradseam.auto)
# The keys "auto" decides for each block itself: given beside it, they would be silently overruled.
AUTO_DECIDES = (
    "gradient_checkpointing_interval", "gradient_checkpointing_segment_stride",
    "gradient_checkpointing_offload_attention", "gradient_checkpointing_keep_attention",
    "gradient_checkpointing_memory_budget", "gradient_checkpointing_blocks",
)
AUTO_BUDGETS = ("gradient_checkpointing_gpu_memory", "gradient_checkpointing_host_memory")
DEFAULT_PIN_BUCKETS = 12
DEFAULT_MEMORY_BUDGET = 0.1  # the compiled backends' activation memory budget when none is given

_GiB = 1 << 30
_SIZE_UNITS = {
    "": _GiB, "g": _GiB, "gb": 10**9, "gib": _GiB, "m": 1 << 20, "mb": 10**6, "mib": 1 << 20,
    "t": 1 << 40, "tb": 10**12, "tib": 1 << 40, "k": 1 << 10, "kb": 10**3, "kib": 1 << 10,
}


def parse_size(value: str | float | int, what: str = "GPU memory size") -> float:
    """A memory size in GiB: ``42.5`` (GiB), ``"40GiB"``, ``"40 GB"`` (10^9 bytes), ``"40960MiB"``; ``what`` begins
    an error's message."""
    if isinstance(value, bool):
        raise ValueError(f"{what}: expected a size like '40GiB' or a number of GiB, got {value!r}.")
    if isinstance(value, (int, float)):
        gib = float(value)
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", str(value))
        unit = match.group(2).lower() if match else ""
        if not match or unit not in _SIZE_UNITS:
            raise ValueError(
                f"{what}: cannot read {value!r}; write a number with a unit, e.g. '40GiB', '40 GB', "
                "'40960MiB', or a plain number of GiB like 42.5."
            )
        gib = float(match.group(1)) * _SIZE_UNITS[unit] / _GiB
    if not gib > 0 or gib == float("inf"):
        raise ValueError(f"{what}: must be a positive finite size, got {value!r}.")
    return gib


_TRUE_STRINGS = {"true": True, "false": False}


def _where(key: str) -> str:
    return f"gradseam config key '{key}'"


# -- parsers: (key, value, nullable) -> the value as stored, or a ValueError that names the key -----

Parser = Callable[[str, Any, bool], Any]


def _parse_bool(key: str, value: Any, nullable: bool = False) -> bool:
    # Truthiness would read "false" as True; only real booleans and the literal JSON words pass.
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _TRUE_STRINGS:
        return _TRUE_STRINGS[value.strip().lower()]
    raise ValueError(f"{_where(key)}: expected true or false, got {value!r} ({type(value).__name__}).")


def _parse_int(key: str, value: Any, *, minimum: int, allow_none: bool) -> int | None:
    if value is None:
        if allow_none:
            return None
        raise ValueError(f"{_where(key)}: expected an integer >= {minimum}, got None.")
    if isinstance(value, bool):  # bool is an int subclass; True must not mean 1 here
        raise ValueError(f"{_where(key)}: expected an integer >= {minimum}, got {value!r} (bool).")
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        # "²" and "--2" pass isdigit() but not int(), nor do strings over int()'s digit limit:
        # those stay a str and are reported below with the key
        with contextlib.suppress(ValueError):
            value = int(value.strip())
    if not isinstance(value, int):
        allowed = f"an integer >= {minimum}" + (" or null" if allow_none else "")
        raise ValueError(f"{_where(key)}: expected {allowed}, got {value!r} ({type(value).__name__}).")
    if value < minimum:
        hint = " (use null to disable)" if allow_none else ""
        raise ValueError(f"{_where(key)}: must be >= {minimum}, got {value}{hint}.")
    return value


def _parse_count(key: str, value: Any, nullable: bool) -> int | None:
    """An integer >= 1 (the interval, the stride)."""
    return _parse_int(key, value, minimum=1, allow_none=nullable)


def _parse_zero_or_more(key: str, value: Any, nullable: bool) -> int | None:
    """An integer >= 0 (0 is meaningful: no pinned memory, no prefetch)."""
    return _parse_int(key, value, minimum=0, allow_none=nullable)


def _parse_budget(key: str, value: Any, nullable: bool = True) -> float | None:
    """A fraction 0 <= B <= 1, or None for the default; strings of a number pass (CLI, YAML). 0 is the compiler's
    own end of the range: a compiled block keeps only its inputs and recomputes the rest, the least it can keep."""
    if value is None:
        return None
    if isinstance(value, str):
        with contextlib.suppress(ValueError):
            value = float(value.strip())
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{_where(key)}: expected a number 0 <= B <= 1 or null, got {value!r} ({type(value).__name__}).")
    if not 0 <= value <= 1:
        raise ValueError(
            f"{_where(key)}: must be >= 0 and <= 1, got {value!r}. It is the fraction of what a compiled block "
            f"would keep without recomputing that it may keep (0: only its inputs; null = {DEFAULT_MEMORY_BUDGET})."
        )
    return float(value)


def _parse_streamed(key: str, value: Any, nullable: bool = True) -> int | str | None:
    """How many blocks stream their weights: an integer N >= 1, or ``"all"`` (any case, spaces around);
    0 and null stream nothing and are stored as None (``blocks_to_swap: 0`` is how other trainers write
    "none"). Strings of digits pass (CLI, YAML); an N above the model's block count is the planner's to refuse."""
    allowed = 'a number of blocks >= 0, "all" or null' if nullable else 'a number of blocks >= 0 or "all"'
    if value is None:
        if nullable:
            return None
        raise ValueError(f"{_where(key)}: expected {allowed}, got None.")
    if isinstance(value, str):
        text = value.strip()
        if text.lower() == "all":
            return "all"
        if text.lstrip("-").isdigit():
            # as _parse_int: "²", "--2" and strings over int()'s digit limit stay a str, reported below
            with contextlib.suppress(ValueError):
                value = int(text)
    if isinstance(value, bool) or not isinstance(value, int):  # bool is an int subclass; True is not 1 block
        raise ValueError(f"{_where(key)}: expected {allowed}, got {value!r} ({type(value).__name__}).")
    if value < 0:
        raise ValueError(f"{_where(key)}: must be >= 0 or \"all\", got {value} (0 or null streams nothing).")
    return value or None


def _parse_backend(key: str, value: Any, nullable: bool = False) -> str:
    allowed = [*BACKENDS, AUTO]
    if not isinstance(value, str):
        raise ValueError(f"{_where(key)}: expected one of {allowed}, got {value!r} ({type(value).__name__}).")
    if value in allowed:
        return value
    close = difflib.get_close_matches(value.strip().lower().replace("_", "-"), allowed, n=1, cutoff=0.5)
    hint = f" Did you mean '{close[0]}'?" if close else ""
    raise ValueError(f"{_where(key)}: {value!r} is not a backend; allowed: {allowed}.{hint}")


def _parse_memory(key: str, value: Any, nullable: bool = True) -> float | None:
    """A memory size in GiB (a number, or text like ``"24GiB"``, ``"24 GB"``), or None for the default."""
    if value is None:
        return None
    try:
        return parse_size(value, _where(key))
    except ValueError as exc:
        raise ValueError(str(exc)) from None


# -- what gradseam says about each key, stated once: beside its field ------------------------------

# The groups keys are listed under in `gradseam run --help`, in this order.
# The keys one entry of gradient_checkpointing_blocks may set for its blocks: what a region does, and whether
# (or how many of) its blocks' weights stream. The interval, the stride, the pinned pool and the stream's prefetch
# are the model's (how blocks group, how far ahead copies run), not a block's.
BLOCK_KEYS = (
    "gradient_checkpointing", "gradient_checkpointing_backend", "gradient_checkpointing_memory_budget",
    "gradient_checkpointing_keep_attention", "gradient_checkpointing_offload_attention",
    "gradient_checkpointing_stream_weights",
)
BLOCKS_KEY = "gradient_checkpointing_blocks"
STREAM_KEY = "gradient_checkpointing_stream_weights"  # the key of weight streaming, read by planning and the tools
SELECTOR = "blocks"  # an entry's block selector: "list", "list[i]" or "list[a:b]" (b exclusive, as in Python)
BlockOverride = tuple[tuple[str, Any], ...]  # ("blocks", selector) first, then the entry's keys as stored


def selector_parts(selector: str) -> tuple[str, int, int | None]:
    """An entry's selector, already validated (:func:`_parse_block_overrides`), as ``(list path, first index, end
    index)``, the end None where it runs to the list's end (``"list"``, ``"list[a:]"``): which blocks that is needs
    the model's list lengths (:func:`gradseam.planning`), whether it is a whole list does not (``gradseam bench``)."""
    path, _, rest = re.sub(r"\s+", "", selector).partition("[")
    inside = rest.rstrip("]")
    if not rest or ":" in inside:
        lo, _, hi = inside.partition(":")
        return path, int(lo or 0), int(hi) if hi else None
    return path, int(inside), int(inside) + 1


def _parse_block_overrides(key: str, value: Any, nullable: bool = True) -> tuple[BlockOverride, ...] | None:
    """Per-block settings: a list of entries, each ``{"blocks": SELECTOR, KEY: VALUE, ...}`` with keys from
    :data:`BLOCK_KEYS`, validated as the top-level keys are (each message names the entry). A JSON string
    passes (the command line). Stored as tuples, so the config stays hashable; which blocks a selector names
    is the planner's to check, against the model's block lists."""
    import re

    if value is None or (isinstance(value, (list, tuple)) and not value):
        return None
    if isinstance(value, str):
        text = value
        try:
            value = json.loads(text, parse_int=_json_int)
        except (json.JSONDecodeError, RecursionError) as exc:  # RecursionError: nesting too deep
            raise ValueError(f"{_where(key)}: expected a JSON list of entries, got {_clipped(text)} ({exc}).") from None
        huge = next((node for _, node in _walk(value) if isinstance(node, _HugeInt)), None)
        if huge is not None:
            raise ValueError(
                f"{_where(key)}: the JSON {_clipped(text)} holds an integer of {huge.digits} digits, more than Python "
                f"converts ({sys.get_int_max_str_digits()}, see sys.set_int_max_str_digits); no gradseam setting takes "
                "such a number.")
    if not isinstance(value, (list, tuple)):
        raise ValueError(
            f"{_where(key)}: expected a list of entries such as "
            '[{"blocks": "transformer_blocks[0:10]", "gradient_checkpointing_backend": "unsloth"}], '
            f"got {value!r} ({type(value).__name__})."
        )
    entries = []
    for i, entry in enumerate(value):
        where = f"{_where(key)}: entry {i}"
        if isinstance(entry, tuple) and all(isinstance(p, tuple) and len(p) == 2 for p in entry):
            entry = dict(entry)  # the stored form, read back (given_keys -> from_dict)
        if not isinstance(entry, Mapping):
            raise ValueError(f"{where}: expected an object with \"{SELECTOR}\" and keys, got {entry!r}.")
        selector = entry.get(SELECTOR)
        if not isinstance(selector, str) or not re.fullmatch(r"\s*[A-Za-z_][\w.]*\s*(\[\s*\d*\s*(:\s*\d*\s*)?\])?\s*",
                                                              selector):
            raise ValueError(
                f"{where}: \"{SELECTOR}\" must name a block list and optionally which of its blocks, as "
                f"'transformer_blocks', 'transformer_blocks[3]' or 'transformer_blocks[0:10]' (the end excluded); "
                f"got {selector!r}."
            )
        keys = [k for k in entry if k != SELECTOR]
        if not keys:
            raise ValueError(f"{where}: sets nothing for {selector!r}; add one of {list(BLOCK_KEYS)}.")
        stored: list[tuple[str, Any]] = [(SELECTOR, re.sub(r"\s+", "", selector))]
        for k in keys:
            if k not in BLOCK_KEYS:
                close = [] if k in KEY_SPECS else difflib.get_close_matches(str(k), BLOCK_KEYS, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                model_wide = " It is the model's, not a block's: set it at the top level." if k in KEY_SPECS else ""
                raise ValueError(
                    f"{where}: {k!r} cannot be set per block{hint}.{model_wide} A block entry sets "
                    f"{', '.join(BLOCK_KEYS)}."
                )
            try:
                stored.append((k, KEY_SPECS[k].read(k, entry[k])))
            except ValueError as exc:
                raise ValueError(f"{where} ({selector!r}): {exc}") from None
            if k == BACKEND_KEY and entry[k] == AUTO:
                raise ValueError(
                    f"{where} ({selector!r}): \"{AUTO}\" plans every block of the model, so it is a top-level "
                    f"gradient_checkpointing_backend, not a block's; name a backend for these blocks.")
        entries.append(tuple(stored))
    return tuple(entries)


GROUP_CHECKPOINTING = "Checkpointing"
GROUP_ATTENTION = "Attention"
GROUP_COMPILED = "Compiled backends"
GROUP_WEIGHTS = "Weight streaming"
GROUP_AUTO = "Planning"  # the keys of gradient_checkpointing_backend "auto"
DEFAULT_STREAM_PREFETCH = 1  # one block ahead hides the copy wherever a block computes longer than it copies
NEEDS_CHECKPOINTING_WORDS = "{needs_checkpointing}"  # in a doc cell: the keys that need checkpointing, listed


@dataclass(frozen=True, kw_only=True)
class KeySpec:
    """Everything about one config key but its name, default and Python type (its dataclass field's).

    Each :class:`CheckpointConfig` field carries one in its metadata (:func:`key_spec`); from them
    come the parsing (:meth:`read`), :data:`NEEDS_CHECKPOINTING`, ``gradseam run``'s options
    (:data:`gradseam.tools.launch.FLAG_KEYS`, the typer options, the help) and docs/options.md's
    table of keys (:func:`render_options_table`). Adding a key is one field with its spec.
    """

    flag: str  # `gradseam run`'s option, e.g. "--segment-stride"; a bool key has its "--no-" form too
    value: type  # what the key holds besides null: bool keys are switches on the command line
    parse: Parser  # the value as written -> as stored; a ValueError names the key
    help: str  # one line, for `gradseam run --help` (after the key's name)
    group: str  # GROUP_*: the section of `gradseam run --help` the option is listed under
    metavar: str = ""  # what the option takes, shown in the help ("N"); bool switches take nothing
    nullable: bool = False  # null is a value: it clears the key back to its default ("null"/"none" as a flag)
    needs_checkpointing: bool = False  # only acts with checkpointing on: setting it turns checkpointing on
    doc_type: str  # docs/options.md's table: the "type" cell
    doc_default: str  # ... the "default" cell (NEEDS_CHECKPOINTING_WORDS is filled in)
    doc: str  # ... the "what it does" cell

    @property
    def flags(self) -> tuple[str, ...]:
        """Every spelling of the option: the flag, and ``--no-...`` for a bool key."""
        return (self.flag, self.negative_flag) if self.negative_flag else (self.flag,)

    @property
    def negative_flag(self) -> str | None:
        """``--no-x`` for a bool key (``--x/--no-x``), else None."""
        return "--no-" + self.flag.removeprefix("--") if self.value is bool else None

    def option_help(self, key: str) -> str:
        """The option's line in ``gradseam run --help``: the key it sets, what it does, how null clears it."""
        null = "; 'null' clears it" if self.nullable else ""
        return f"{key}: {self.help}{null}"

    def read(self, key: str, value: Any) -> Any:
        """``value`` as the config stores it: parsed, or None where the key is nullable and null was written."""
        if value is None and self.nullable:
            return None
        return self.parse(key, value, self.nullable)


_SPEC = "gradseam"  # the metadata entry of a field that holds its KeySpec


def _key(default: Any, spec: KeySpec) -> Any:
    """A config field: its default and its :class:`KeySpec`."""
    return field(default=default, metadata={_SPEC: spec})


# -- JSON files: what json.loads would take silently or report without the file and key ----------


class _Duplicates:
    """An ``object_pairs_hook`` that builds plain dicts and remembers which of them saw a key twice
    (json keeps the last value silently). It holds the dicts, so their ids stay theirs."""

    def __init__(self) -> None:
        self.found: list[tuple[dict[str, Any], str]] = []

    def __call__(self, pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        obj: dict[str, Any] = {}
        for key, value in pairs:
            if key in obj:
                self.found.append((obj, key))
            obj[key] = value
        return obj

    def by_id(self) -> dict[int, str]:
        first: dict[int, str] = {}
        for obj, key in self.found:
            first.setdefault(id(obj), key)
        return first


@dataclass(frozen=True)
class _HugeInt:
    """An integer literal longer than ``int()`` converts; kept as a marker so the key can be named."""

    digits: int


def _json_int(text: str) -> int | _HugeInt:
    try:
        return int(text)
    except ValueError:  # only raised past sys.get_int_max_str_digits(); json validated the syntax
        return _HugeInt(len(text.lstrip("-")))


def _clipped(text: str, keep: int = 120) -> str:
    """``repr(text)``, its middle cut out past ``keep`` characters: an error names the value without a page of it."""
    shown = repr(text)
    return shown if len(shown) <= keep else f"{shown[:keep // 2]}...{shown[-keep // 2:]} ({len(text)} characters)"


def _walk(data: Any) -> Iterator[tuple[str, Any]]:
    """(key path, value) for every value of a parsed document, in document order, without recursion
    (a file nested close to the recursion limit parses, and must not fail here instead)."""
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:
        where, node = stack.pop()
        yield where, node
        if isinstance(node, dict):
            children = [(f"{where}.{k}" if where else str(k), v) for k, v in node.items()]
        elif isinstance(node, list):
            children = [(f"{where}[{i}]", v) for i, v in enumerate(node)]
        else:
            continue
        stack.extend(reversed(children))


def _check_json(path: str, data: Any, duplicates: _Duplicates) -> None:
    twice = duplicates.by_id()
    for where, node in _walk(data):
        if isinstance(node, dict) and id(node) in twice:
            key = f"{where}.{twice[id(node)]}" if where else twice[id(node)]
            raise ValueError(
                f"gradseam config file {path!r}: key {key!r} appears more than once. JSON readers keep the "
                "last value without a word, so the file does not say which one it means; remove the duplicate."
            )
        if isinstance(node, _HugeInt):
            limit = sys.get_int_max_str_digits()
            raise ValueError(
                f"gradseam config file {path!r}: key {where!r} holds an integer of {node.digits} digits, "
                f"more than Python converts ({limit}, see sys.set_int_max_str_digits); no gradseam setting "
                "takes such a number."
            )


def _config_type_error(value: Any) -> TypeError:
    hint = ""
    if isinstance(value, bool):
        hint = " To switch checkpointing on, pass gradient_checkpointing=True or {'gradient_checkpointing': True}."
    elif isinstance(value, (list, tuple)):
        hint = " A list of pairs is not a mapping: pass dict(...) of it."
    elif isinstance(value, bytes):
        hint = " A path must be str or os.PathLike: decode it."
    shown = repr(value)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    return TypeError(
        "gradseam: the config argument must be a CheckpointConfig, a mapping of config keys, the path of a "
        f"JSON config file (str or os.PathLike), or None (keyword arguments only); got "
        f"{type(value).__name__} {shown}.{hint}"
    )


_PREFIX = "gradient_checkpointing_"

# What to do about an unknown key depends on where it was written: only from_dict / from_json take
# ignore_unknown (patch() and patching() read every keyword as a key and refuse ignore_unknown).
REMEDY_FROM_DICT = "Pass ignore_unknown=True to read the gradseam keys out of a larger trainer config."
REMEDY_PATCH = (
    "gradseam.patch() and gradseam.patching() read every key of a mapping and every keyword argument as a "
    "gradseam config key (they take no ignore_unknown); to read the gradseam keys out of a larger trainer "
    "config, pass CheckpointConfig.from_dict(trainer_config, ignore_unknown=True) as the config."
)


def _remedy_file(path: str) -> str:
    return (f"To read the gradseam keys out of a whole trainer config file, pass "
            f"CheckpointConfig.from_json({path!r}, ignore_unknown=True) as the config.")


def suggest_key(key: Any, known: tuple[str, ...] | None = None) -> str | None:
    """The config key ``key`` most likely stands for: a typo (``gradient_checkpointing_intervall``), a
    short name without the prefix (``backend``, ``interval``, ``stride``, ``budget``), a flag's
    spelling (``--segment-stride``) or another case; None when nothing is close."""
    known = tuple(known or CheckpointConfig.keys())
    written = str(key)
    text = written.strip().lstrip("-").replace("-", "_").lower()
    if text in known:
        return text
    if text == "checkpointing":
        return "gradient_checkpointing"
    if _PREFIX + text in known:
        return _PREFIX + text
    close = difflib.get_close_matches(written, sorted(known), n=1, cutoff=0.6)
    if close:
        return close[0]
    shorts = {k.removeprefix(_PREFIX): k for k in known if k.startswith(_PREFIX)}
    close = difflib.get_close_matches(text.removeprefix(_PREFIX), sorted(shorts), n=1, cutoff=0.75)
    if close:
        return shorts[close[0]]
    ends = [k for k in known if text and k.endswith("_" + text)]
    return ends[0] if len(ends) == 1 else None


def _unknown_key_error(key: Any, remedy: str, where: str = "") -> ValueError:
    known = sorted(CheckpointConfig.keys())
    close = suggest_key(key, tuple(known))
    hint = f" Did you mean '{close}'?" if close else ""
    return ValueError(f"unknown gradseam config key {key!r}{where}.{hint} Valid keys: {known}. {remedy}")


def read_json_keys(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The keys of a JSON config file as written (nothing resolved), every file-level mistake named."""
    where = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as file:
            text = file.read()
    except FileNotFoundError:
        raise ConfigFileNotFoundError(
            where,
            f"gradseam config file {where!r} does not exist (looked for {os.path.abspath(where)!r}). A str or "
            "os.PathLike config is read as the path of a JSON file holding an object of gradseam config keys, "
            'such as {"gradient_checkpointing": true}; check the path, or pass the keys as a dict, a '
            "CheckpointConfig or keyword arguments.",
        ) from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"gradseam config file {where!r} is not UTF-8 text: {exc}") from None
    duplicates = _Duplicates()
    try:
        data = json.loads(text, object_pairs_hook=duplicates, parse_int=_json_int)
    except (json.JSONDecodeError, RecursionError) as exc:  # RecursionError: nesting too deep
        raise ValueError(f"gradseam config file {where!r} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(
            f"gradseam config file {where!r} must hold a JSON object of keys, got {type(data).__name__}."
        )
    _check_json(where, data, duplicates)
    return data


@dataclass(frozen=True)
class CheckpointConfig:
    """Which strategy gradseam applies; field names are exactly the keys users write.

    Build it with keyword arguments, :meth:`from_dict` (a trainer config) or :meth:`from_json`.
    Each field's :class:`KeySpec` (its metadata) says how the key is parsed, its ``gradseam run``
    option and its row in docs/options.md.
    """

    gradient_checkpointing: bool | None = _key(None, KeySpec(  # None: left out, decided by NEEDS_CHECKPOINTING
        flag="--checkpointing", value=bool, parse=_parse_bool, group=GROUP_CHECKPOINTING,
        help="checkpoint at all (default: on with no option, or with any option that needs it; off leaves "
             "only attention offload)",
        doc_type="bool",
        doc_default=f"left out: `true` when the {NEEDS_CHECKPOINTING_WORDS} key is given, else `false`",
        doc="turns checkpointing on; set to `false`, the keys below except the two offload keys do nothing "
            "([warnings](#warnings)), and a memory budget or weight streaming is refused"))
    gradient_checkpointing_backend: str | None = _key(None, KeySpec(  # None: left out, read as DEFAULT_BACKEND
        flag="--backend", value=str, metavar="NAME", parse=_parse_backend, group=GROUP_CHECKPOINTING,
        needs_checkpointing=True,  # counts when given at all, "torch" included
        help=f"what each region covers and keeps: {' | '.join(BACKENDS)}, or {AUTO} to plan each block (default "
             f"{DEFAULT_BACKEND})",
        doc_type=", ".join(f'`"{name}"`' for name in [*BACKENDS, AUTO]), doc_default=f'`"{DEFAULT_BACKEND}"`',
        doc="what each region covers, what it keeps and whether that goes to CPU memory "
            "([Strategies](strategies.md)); `\"auto\"` plans each block within the GPU and host memory below "
            "([auto](strategies.md#auto-each-block-planned-for-your-gpu-and-host))"))
    gradient_checkpointing_interval: int | None = _key(None, KeySpec(
        flag="--interval", value=int, metavar="N", parse=_parse_count, group=GROUP_CHECKPOINTING,
        nullable=True, needs_checkpointing=True,
        help="chunks of N blocks per region",
        doc_type="int ≥ 1 or null", doc_default="null (one block per region)",
        doc="blocks per checkpoint region (consecutive blocks run as one chunk)"))
    gradient_checkpointing_segment_stride: int | None = _key(None, KeySpec(
        flag="--segment-stride", value=int, metavar="S", parse=_parse_count, group=GROUP_CHECKPOINTING,
        nullable=True, needs_checkpointing=True,
        help="checkpoint the first N (the interval) of every S blocks",
        doc_type="int ≥ interval, or null", doc_default="null (every block)",
        doc="in each window of `stride` blocks, only the first `interval` are checkpointed"))
    gradient_checkpointing_offload_attention: bool = _key(False, KeySpec(
        flag="--offload-attention", value=bool, parse=_parse_bool, group=GROUP_ATTENTION,
        help="move what attention saves for backward to CPU memory (CUDA only; with or without checkpointing)",
        doc_type="bool", doc_default="`false`",
        doc="move what attention saves for backward to CPU memory (CUDA only); works with or without "
            "checkpointing"))
    gradient_checkpointing_offload_pin_memory_max_buckets: int = _key(DEFAULT_PIN_BUCKETS, KeySpec(
        flag="--offload-pin-memory-max-buckets", value=int, metavar="N", parse=_parse_zero_or_more,
        group=GROUP_ATTENTION,
        help=f"size classes of pinned host buffers the offload pool may keep; 0 = pageable memory only "
             f"(default {DEFAULT_PIN_BUCKETS})",
        doc_type="int ≥ 0", doc_default=f"`{DEFAULT_PIN_BUCKETS}`",
        doc="how many size classes of pinned host buffers the offload pool may keep; 0 = pageable memory only"))
    gradient_checkpointing_keep_attention: bool = _key(False, KeySpec(
        flag="--keep-attention", value=bool, parse=_parse_bool, group=GROUP_ATTENTION,
        needs_checkpointing=True,
        help="inside whole-block regions, keep the attention kernels' outputs instead of recomputing them",
        doc_type="bool", doc_default="`false`",
        doc="inside whole-block regions, keep the attention kernels' outputs on the GPU instead of "
            "recomputing them"))
    gradient_checkpointing_memory_budget: float | None = _key(None, KeySpec(
        flag="--memory-budget", value=float, metavar="B", parse=_parse_budget, group=GROUP_COMPILED,
        nullable=True, needs_checkpointing=True,
        help=f"the compiler's activation memory budget of the compiled backends, 0 <= B <= 1 "
             f"(default {DEFAULT_MEMORY_BUDGET})",
        doc_type="number, 0 ≤ B ≤ 1, or null", doc_default=f"null ({DEFAULT_MEMORY_BUDGET})",
        doc="the compiled backends only: the compiler's activation memory budget for each compiled block"))
    gradient_checkpointing_stream_weights: int | str | None = _key(None, KeySpec(
        flag="--stream-weights", value=str, metavar="N|all", parse=_parse_streamed, group=GROUP_WEIGHTS,
        nullable=True, needs_checkpointing=True,  # streamed blocks are released after forward, reloaded to recompute
        help="keep the frozen weights of N blocks, spread by size (or all), in host memory, copied to the GPU as "
             "each block runs",
        doc_type='int ≥ 0, `"all"` or null', doc_default="null (nothing streams; so does `0`)",
        doc="moves the frozen base weights of N blocks, spread over the forward order, larger blocks farther apart "
            "(`\"all\"`: every block), to host memory and copies them to the GPU as each block runs; LoRA and other trainable "
            "parameters stay on the GPU. musubi-tuner's `blocks_to_swap` counts blocks the same way (which "
            "blocks it picks may differ) ([weight streaming](strategies.md#weights-that-do-not-fit-streaming-them-from-host-memory))"))
    gradient_checkpointing_stream_prefetch: int = _key(DEFAULT_STREAM_PREFETCH, KeySpec(
        flag="--stream-prefetch", value=int, metavar="N", parse=_parse_zero_or_more, group=GROUP_WEIGHTS,
        help=f"streamed weights: how many blocks ahead of the running one are copied (default "
             f"{DEFAULT_STREAM_PREFETCH}; 0 = each block's copy is waited for when it runs)",
        doc_type="int ≥ 0", doc_default=f"`{DEFAULT_STREAM_PREFETCH}`",
        doc="with streamed weights: how many blocks ahead of the running one are copied to the GPU on a side "
            "stream while it computes (the GPU holds 1 + N streamed blocks' weights); 0 copies each block when "
            "it runs and waits for it (no overlap: the reference the overlap is measured against)"))

    gradient_checkpointing_gpu_memory: float | None = _key(None, KeySpec(
        flag="--gpu-memory", value=str, metavar="SIZE", parse=_parse_memory, group=GROUP_AUTO, nullable=True,
        help='with backend auto: the GPU memory the step may use, e.g. "24GiB" (default: what the GPU has free '
             "and this process holds, less 5%)",
        doc_type='size (`"24GiB"`, `"24 GB"`, GiB as a number) or null',
        doc_default="null (the GPU's free memory plus what this process holds, within its memory fraction, less 5%)",
        doc='with `\"auto\"` only: the GPU memory the planned step may use, weights and inputs included'))
    gradient_checkpointing_host_memory: float | None = _key(None, KeySpec(
        flag="--host-memory", value=str, metavar="SIZE", parse=_parse_memory, group=GROUP_AUTO, nullable=True,
        help="with backend auto: the pinned host memory the plan may use (default: 3/4 of the host's available memory)",
        doc_type='size or null', doc_default="null (three quarters of the host's available memory)",
        doc='with `\"auto\"` only: the pinned host memory the plan may use for what it offloads'))

    gradient_checkpointing_blocks: tuple[BlockOverride, ...] | None = _key(None, KeySpec(
        flag="--blocks", value=str, metavar="JSON", parse=_parse_block_overrides, group=GROUP_CHECKPOINTING,
        nullable=True,
        help='per-block settings, a JSON list: [{"blocks": "transformer_blocks[0:10]", '
             '"gradient_checkpointing_backend": "unsloth"}]',
        doc_type='list of `{"blocks": ..., key: value}` or null', doc_default="null (every block as the keys above)",
        doc="settings for some blocks: each entry names a block list and a range (`\"blocks[0:10]\"`, the end "
            "excluded) and sets any of `gradient_checkpointing`, `..._backend`, `..._memory_budget`, "
            "`..._keep_attention`, `..._offload_attention`, `..._stream_weights` (N of its blocks, `\"all\"` or "
            "0) for them, over the keys above; later entries win "
            "([per-block plans](strategies.md#per-block-plans))"))

    def __post_init__(self) -> None:
        # Frozen dataclass: normalise through object.__setattr__ so the stored values are the parsed ones.
        set_ = object.__setattr__
        left_out = frozenset(k for k in LEFT_OUT if getattr(self, k) is None)
        for key, spec in KEY_SPECS.items():
            if key not in left_out:
                set_(self, key, spec.read(key, getattr(self, key)))
        interval, stride = self.gradient_checkpointing_interval, self.gradient_checkpointing_segment_stride
        if stride is not None and stride < (interval or 1):
            raise ValueError(
                f"{_where('gradient_checkpointing_segment_stride')}: must be >= "
                f"gradient_checkpointing_interval ({interval or 1}), got {stride}. In each window of "
                "`stride` blocks the first `interval` are checkpointed, so the window cannot be shorter."
            )
        set_(self, "_left_out", left_out)  # not a field: which keys were left out (warn_if_idle, given_keys)
        if "gradient_checkpointing" in left_out:
            # The one rule of patch(), patching() and `gradseam run`: left out, checkpointing is on when
            # a key that only acts with it is set (the backend even at "torch"; the others away from
            # their default).
            set_(self, "gradient_checkpointing", any(
                getattr(self, key) not in (None, False) for key in NEEDS_CHECKPOINTING))
        if BACKEND_KEY in left_out:
            set_(self, BACKEND_KEY, DEFAULT_BACKEND)
        self._check_auto_keys()

    def _check_auto_keys(self) -> None:
        """``"auto"`` decides :data:`AUTO_DECIDES` for each block, and its budgets mean nothing to a named backend:
        either given where it cannot act would be silently ignored, so both are refused, naming the keys."""
        if self.backend != AUTO:
            budgets = [key for key in AUTO_BUDGETS if getattr(self, key) is not None]
            if budgets:
                raise ValueError(
                    f"{_where(budgets[0])}: read only with gradient_checkpointing_backend \"{AUTO}\" (the budgets it "
                    f"plans each block within), but the backend is {self.backend!r}. Set the backend to \"{AUTO}\", or "
                    "leave the key out (gradseam advise --gpu-memory SIZE finds the fastest backend for a GPU).")
            return
        decided = [key for key in AUTO_DECIDES if getattr(self, key) not in (None, False)]
        if decided:
            raise ValueError(
                f"{_where(decided[0])}: gradient_checkpointing_backend \"{AUTO}\" chooses {', '.join(decided)} for each "
                "block itself, so the value given would be overruled. Leave it out, or name a backend and keep it.")
        if self.stream_weights is not None:
            raise ValueError(
                f"{_where('gradient_checkpointing_stream_weights')}: gradient_checkpointing_backend \"{AUTO}\" decides "
                "which blocks' weights stream itself (a model larger than the GPU budget streams every block from "
                "patch time), so the value given would be overruled. Leave it out, or to choose the streamed blocks "
                "yourself name a backend beside it (gradseam advise --family NAME --preset NAME --gpu-memory SIZE "
                "measures the candidates at two shallow depths, streamed ones included, and prints the keys).")

    def warn_if_idle(self, entry: str) -> None:
        """Warn (once) where this config, given to ``entry``, sets what cannot act: checkpointing is off.

        A kept-attention setting warns where the plan sees it, a memory budget is refused there.
        """
        if self.enabled or self.gradient_checkpointing_blocks:  # per-block entries may turn it on for their blocks
            return
        idle = [k for k in ("gradient_checkpointing_interval", "gradient_checkpointing_segment_stride")
                if getattr(self, k) is not None]
        if self.backend != "torch":
            idle.insert(0, BACKEND_KEY)
        if idle:
            warn_once(f"{', '.join(idle)} set but gradient_checkpointing is false: no checkpointing will run. "
                      "Set gradient_checkpointing to true to use them, or leave it out.")
        elif not self.offload_attention and "gradient_checkpointing" in self._keys_left_out():
            warn_once(f"{entry}: gradient_checkpointing is off and nothing is offloaded, so the model runs as it is. "
                      "Pass gradient_checkpointing=True (or any backend) to checkpoint.")

    # Short names for code; the long ones stay the source of truth.
    @property
    def enabled(self) -> bool:
        return self.gradient_checkpointing

    @property
    def backend(self) -> str:
        return self.gradient_checkpointing_backend

    @property
    def interval(self) -> int:
        return self.gradient_checkpointing_interval or 1

    @property
    def stride(self) -> int | None:
        return self.gradient_checkpointing_segment_stride

    @property
    def offload_attention(self) -> bool:
        return self.gradient_checkpointing_offload_attention

    @property
    def pin_buckets(self) -> int:
        return self.gradient_checkpointing_offload_pin_memory_max_buckets

    @property
    def keep_attention(self) -> bool:
        return self.gradient_checkpointing_keep_attention

    @property
    def memory_budget(self) -> float:
        """The compiled backends' activation memory budget (the default when the key is null)."""
        budget = self.gradient_checkpointing_memory_budget
        return DEFAULT_MEMORY_BUDGET if budget is None else budget

    @property
    def stream_weights(self) -> int | str | None:
        """How many blocks stream their frozen weights: None (none), an int >= 1, or ``"all"``."""
        return self.gradient_checkpointing_stream_weights

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    def given_keys(self) -> dict[str, Any]:
        """The keys as they were given, before the defaults were resolved: every field, except
        ``gradient_checkpointing`` where it was left out and ``gradient_checkpointing_backend`` where it
        was not given (left out, they are decided from the other keys). What a config contributes
        when ``patch()`` merges keyword arguments over it: ``CheckpointConfig.from_dict(given_keys())``
        equals the config, and so does the merge of the same keys from any sources."""
        left_out = self._keys_left_out()
        return {key: value for key, value in asdict(self).items() if key not in left_out}

    def _keys_left_out(self) -> frozenset[str]:
        """The keys of :data:`LEFT_OUT` this config was built without (their values were decided)."""
        left_out: frozenset[str] = getattr(self, "_left_out", frozenset())
        return left_out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, ignore_unknown: bool = False) -> CheckpointConfig:
        """Read the gradseam keys from a mapping; with ``ignore_unknown`` a whole trainer config can be passed."""
        if not isinstance(data, Mapping):
            raise TypeError(f"gradseam config must be a mapping of keys to values, got {type(data).__name__}.")
        return cls._resolve(data, REMEDY_FROM_DICT, ignore_unknown=ignore_unknown)

    @classmethod
    def _resolve(cls, data: Mapping[str, Any], remedy: str, *, ignore_unknown: bool = False,
                 origin: Mapping[str, str] | None = None) -> CheckpointConfig:
        """The one resolution of user keys: unknown keys refused (with ``remedy``, and the file a key came
        from per ``origin``), written nulls refused where null means "not given", then the defaults."""
        known = set(cls.keys())
        unknown = [k for k in data if k not in known]
        if unknown and not ignore_unknown:
            key = unknown[0]
            path = (origin or {}).get(key)
            if path is not None:
                raise _unknown_key_error(key, _remedy_file(path), f" in gradseam config file {path!r}")
            raise _unknown_key_error(key, remedy)
        keys = {k: v for k, v in data.items() if k in known}
        for key in LEFT_OUT:
            if key in keys and keys[key] is None:
                # None is the field's "left out", not a value to write: refused like any other non-value
                KEY_SPECS[key].parse(key, None, False)
        return cls(**keys)

    @classmethod
    def from_json(cls, path: str | os.PathLike[str], *, ignore_unknown: bool = False) -> CheckpointConfig:
        """Read the gradseam keys from a JSON file (an object of keys). A missing file is a
        :class:`gradseam.errors.ConfigFileNotFoundError` (a ``FileNotFoundError``)."""
        return cls.from_dict(read_json_keys(path), ignore_unknown=ignore_unknown)

    @classmethod
    def coerce(
        cls, value: CheckpointConfig | Mapping[str, Any] | str | os.PathLike[str] | None = None, **kwargs: Any
    ) -> CheckpointConfig:
        """Accept what ``patch`` accepts: a config, a mapping, a JSON file path, or keyword arguments.

        One rule whatever the mix: the keys as given (a file's or a mapping's keys as written, a
        config's :meth:`given_keys`), then the keyword arguments over them key by key, resolved once,
        so the result is the config of the same keys in one dict (and what ``gradseam run --config FILE``
        with the same keys as options gives). A key left out is decided from the merged keys, never
        from a source's own defaults: a file without ``gradient_checkpointing`` plus
        ``gradient_checkpointing_backend="torch"`` checkpoints.

        Anything else is a TypeError rather than falling back to the defaults: ``patch(model, True)``
        or ``patch(model, [])`` would otherwise train without checkpointing while the user believes
        it is on. ``ignore_unknown`` is refused as a keyword: here every keyword is a config key, and
        quietly dropping unknown ones would turn every typo into a default.
        """
        if "ignore_unknown" in kwargs:
            raise TypeError(
                "gradseam: ignore_unknown is not a config key, and patch() / patching() read every keyword as "
                "one. To read the gradseam keys out of a larger trainer config, pass "
                "CheckpointConfig.from_dict(trainer_config, ignore_unknown=True) (or "
                "CheckpointConfig.from_json(path, ignore_unknown=True)) as the config."
            )
        origin: dict[str, str] = {}
        if isinstance(value, (str, os.PathLike)):
            if isinstance(value, str) and value.lstrip().startswith("{") and not os.path.exists(value):
                raise ValueError(
                    "gradseam: a str config is read as the path of a JSON file, but this one looks like JSON "
                    "text; pass json.loads(text) instead."
                )
            path = os.fspath(value)
            value = read_json_keys(path)
            origin = dict.fromkeys(value, path)
        if isinstance(value, CheckpointConfig):
            if not kwargs:
                return value
            value = value.given_keys()
        elif value is None:
            value = {}
        elif not isinstance(value, Mapping):
            raise _config_type_error(value)
        for key in kwargs:
            origin.pop(key, None)  # a keyword replaces the file's key
        return cls._resolve({**value, **kwargs}, REMEDY_PATCH, origin=origin)

    def to_dict(self) -> dict[str, Any]:
        """The keys as a trainer would write them (JSON-ready)."""
        data = asdict(self)
        if self.gradient_checkpointing_blocks is not None:
            data[BLOCKS_KEY] = [dict(entry) for entry in self.gradient_checkpointing_blocks]
        return data

    def for_blocks(self, entries: tuple[BlockOverride, ...]) -> CheckpointConfig:
        """This config with ``entries``' keys over its own (later entries win), as the blocks they select run
        it: the keys as given, then the entries', resolved once (a backend set for some blocks turns
        checkpointing on for them as it would at the top level). No per-block entries of its own."""
        merged = {k: v for k, v in self.given_keys().items() if k != BLOCKS_KEY}
        for entry in entries:
            merged.update((k, v) for k, v in entry if k != SELECTOR)
        return CheckpointConfig.from_dict(merged)

    def describe(self) -> str:
        parts = [self.backend if self.enabled else "no checkpointing"]
        if self.enabled and self.gradient_checkpointing_interval:
            parts.append(f"interval {self.interval}")
        if self.enabled and self.stride:
            parts.append(f"stride {self.stride}")
        if self.offload_attention:
            parts.append("attention offload")
        elif self.keep_attention:
            parts.append("attention kept")
        if self.enabled and self.gradient_checkpointing_memory_budget is not None:
            parts.append(f"memory budget {self.memory_budget:g}")
        for key, what in zip(AUTO_BUDGETS, ("GPU", "host")):
            if getattr(self, key) is not None:
                parts.append(f"{what} memory {getattr(self, key):g} GiB")
        if self.gradient_checkpointing_blocks:
            parts.append(f"{len(self.gradient_checkpointing_blocks)} per-block "
                         f"entr{'y' if len(self.gradient_checkpointing_blocks) == 1 else 'ies'}")
        streamed = self.gradient_checkpointing_stream_weights
        if streamed is not None:
            ahead = self.gradient_checkpointing_stream_prefetch
            parts.append(f"weights of {streamed} block{'' if streamed == 1 else 's'} streamed"
                         + (f" (prefetch {ahead})" if ahead != DEFAULT_STREAM_PREFETCH else ""))
        return ", ".join(parts)


KEY_SPECS: dict[str, KeySpec] = {f.name: f.metadata[_SPEC] for f in fields(CheckpointConfig)}
# Keys whose field default None means "left out": decided from the other keys, never written as null
# (gradient_checkpointing by the rule below, the backend as DEFAULT_BACKEND).
LEFT_OUT: tuple[str, ...] = tuple(
    f.name for f in fields(CheckpointConfig) if f.default is None and not KEY_SPECS[f.name].nullable)
# Keys that only act with checkpointing on: setting one (and leaving gradient_checkpointing out) turns it
# on; setting one beside an explicit `gradient_checkpointing: false` warns (CheckpointConfig.warn_if_idle).
# Attention offload and the pinned pool work without checkpointing, so they turn nothing on.
NEEDS_CHECKPOINTING: tuple[str, ...] = tuple(key for key, spec in KEY_SPECS.items() if spec.needs_checkpointing)
BACKEND_KEY = "gradient_checkpointing_backend"


def key_spec(key: str) -> KeySpec:
    """The :class:`KeySpec` of a config key (a KeyError for anything else)."""
    return KEY_SPECS[key]


def render_options_table() -> str:
    """docs/options.md's table of keys (type, default, what each does), from the keys' specs.

    tests/test_config_keys.py holds the page to this rendering, so the table cannot drift from the code.
    """
    needs = [KEY_SPECS[key].flag.removeprefix("--") for key in NEEDS_CHECKPOINTING]
    words = ", ".join(needs[:-1]) + " or " + needs[-1] if len(needs) > 1 else "".join(needs)
    lines = ["| key | type | default | what it does |", "|---|---|---|---|"]
    for key, spec in KEY_SPECS.items():
        default = spec.doc_default.replace(NEEDS_CHECKPOINTING_WORDS, words)
        lines.append(f"| `{key}` | {spec.doc_type} | {default} | {spec.doc} |")
    return "\n".join(lines) + "\n"
