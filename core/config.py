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
import sys
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from .backends import CATALOG
from .errors import warn_once

BACKENDS: tuple[str, ...] = tuple(CATALOG)
DEFAULT_PIN_BUCKETS = 12
DEFAULT_MEMORY_BUDGET = 0.1  # the compiled backends' activation memory budget when none is given

_TRUE_STRINGS = {"true": True, "false": False}


def _where(key: str) -> str:
    return f"gradseam config key '{key}'"


def _parse_bool(key: str, value: Any) -> bool:
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


def _parse_budget(key: str, value: Any) -> float | None:
    """A fraction 0 < B <= 1, or None for the default; strings of a number pass (CLI, YAML)."""
    if value is None:
        return None
    if isinstance(value, str):
        with contextlib.suppress(ValueError):
            value = float(value.strip())
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{_where(key)}: expected a number 0 < B <= 1 or null, got {value!r} ({type(value).__name__}).")
    if not 0 < value <= 1:
        raise ValueError(
            f"{_where(key)}: must be > 0 and <= 1, got {value!r}. It is the fraction of what a compiled block "
            f"would keep without recomputing that it may keep (null = {DEFAULT_MEMORY_BUDGET})."
        )
    return float(value)


def _parse_backend(value: Any) -> str:
    key = "gradient_checkpointing_backend"
    if not isinstance(value, str):
        raise ValueError(f"{_where(key)}: expected one of {list(BACKENDS)}, got {value!r} ({type(value).__name__}).")
    if value in BACKENDS:
        return value
    close = difflib.get_close_matches(value.strip().lower().replace("_", "-"), BACKENDS, n=1, cutoff=0.5)
    hint = f" Did you mean '{close[0]}'?" if close else ""
    raise ValueError(f"{_where(key)}: {value!r} is not a backend; allowed: {list(BACKENDS)}.{hint}")


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


# Keys that only act with checkpointing on: setting one (and leaving gradient_checkpointing out) turns it
# on; setting one beside an explicit `gradient_checkpointing: false` warns (CheckpointConfig.warn_if_idle).
# Attention offload and the pinned pool work without checkpointing, so they turn nothing on.
NEEDS_CHECKPOINTING = (
    "gradient_checkpointing_backend",  # counts when given at all, "torch" included (its field's None: not given)
    "gradient_checkpointing_interval",
    "gradient_checkpointing_segment_stride",
    "gradient_checkpointing_keep_attention",
    "gradient_checkpointing_memory_budget",
)
BACKEND_KEY = "gradient_checkpointing_backend"


@dataclass(frozen=True)
class CheckpointConfig:
    """Which strategy gradseam applies; field names are exactly the keys users write.

    Build it with keyword arguments, :meth:`from_dict` (a trainer config) or :meth:`from_json`.
    """

    gradient_checkpointing: bool | None = None  # None: on where a key that needs it is set (NEEDS_CHECKPOINTING)
    gradient_checkpointing_backend: str | None = None  # None: not given, read as "torch"
    gradient_checkpointing_interval: int | None = None
    gradient_checkpointing_segment_stride: int | None = None
    gradient_checkpointing_offload_attention: bool = False
    gradient_checkpointing_offload_pin_memory_max_buckets: int = DEFAULT_PIN_BUCKETS
    gradient_checkpointing_keep_attention: bool = False
    gradient_checkpointing_memory_budget: float | None = None

    def __post_init__(self) -> None:
        # Frozen dataclass: normalise through object.__setattr__ so the stored values are the parsed ones.
        set_ = object.__setattr__
        auto = self.gradient_checkpointing is None
        if not auto:
            set_(self, "gradient_checkpointing", _parse_bool("gradient_checkpointing", self.gradient_checkpointing))
        given_backend = self.gradient_checkpointing_backend is not None
        set_(self, "gradient_checkpointing_backend",
             _parse_backend(self.gradient_checkpointing_backend) if given_backend else "torch")
        interval = _parse_int(
            "gradient_checkpointing_interval", self.gradient_checkpointing_interval, minimum=1, allow_none=True
        )
        stride = _parse_int(
            "gradient_checkpointing_segment_stride",
            self.gradient_checkpointing_segment_stride,
            minimum=1,
            allow_none=True,
        )
        if stride is not None and stride < (interval or 1):
            raise ValueError(
                f"{_where('gradient_checkpointing_segment_stride')}: must be >= "
                f"gradient_checkpointing_interval ({interval or 1}), got {stride}. In each window of "
                "`stride` blocks the first `interval` are checkpointed, so the window cannot be shorter."
            )
        set_(self, "gradient_checkpointing_interval", interval)
        set_(self, "gradient_checkpointing_segment_stride", stride)
        set_(
            self,
            "gradient_checkpointing_offload_attention",
            _parse_bool("gradient_checkpointing_offload_attention", self.gradient_checkpointing_offload_attention),
        )
        set_(
            self,
            "gradient_checkpointing_memory_budget",
            _parse_budget("gradient_checkpointing_memory_budget", self.gradient_checkpointing_memory_budget),
        )
        set_(
            self,
            "gradient_checkpointing_keep_attention",
            _parse_bool("gradient_checkpointing_keep_attention", self.gradient_checkpointing_keep_attention),
        )
        set_(
            self,
            "gradient_checkpointing_offload_pin_memory_max_buckets",
            _parse_int(
                "gradient_checkpointing_offload_pin_memory_max_buckets",
                self.gradient_checkpointing_offload_pin_memory_max_buckets,
                minimum=0,
                allow_none=False,
            ),
        )
        set_(self, "_left_out", auto)  # not a field: how the value came, for warn_if_idle only
        if auto:
            # The one rule of patch(), patching() and `gradseam run`: left out, checkpointing is on when
            # a key that only acts with it is set (the backend even at "torch"; the others away from
            # their default).
            set_(self, "gradient_checkpointing", given_backend or any(
                getattr(self, key) not in (None, False) for key in NEEDS_CHECKPOINTING[1:]))

    def warn_if_idle(self, entry: str) -> None:
        """Warn (once) where this config, given to ``entry``, sets what cannot act: checkpointing is off.

        A kept-attention setting warns where the plan sees it, a memory budget is refused there.
        """
        if self.enabled:
            return
        idle = [k for k in ("gradient_checkpointing_interval", "gradient_checkpointing_segment_stride")
                if getattr(self, k) is not None]
        if self.backend != "torch":
            idle.insert(0, BACKEND_KEY)
        if idle:
            warn_once(f"{', '.join(idle)} set but gradient_checkpointing is false: no checkpointing will run. "
                      "Set gradient_checkpointing to true to use them, or leave it out.")
        elif not self.offload_attention and getattr(self, "_left_out", False):
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

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, ignore_unknown: bool = False) -> CheckpointConfig:
        """Read the gradseam keys from a mapping; with ``ignore_unknown`` a whole trainer config can be passed."""
        if not isinstance(data, Mapping):
            raise TypeError(f"gradseam config must be a mapping of keys to values, got {type(data).__name__}.")
        known = set(cls.keys())
        unknown = [k for k in data if k not in known]
        if unknown and not ignore_unknown:
            key = unknown[0]
            close = difflib.get_close_matches(str(key), sorted(known), n=1, cutoff=0.6)
            hint = f" Did you mean '{close[0]}'?" if close else ""
            raise ValueError(
                f"unknown gradseam config key {key!r}.{hint} Valid keys: {sorted(known)}. "
                "Pass ignore_unknown=True to read the gradseam keys out of a larger trainer config."
            )
        keys = {k: v for k, v in data.items() if k in known}
        if "gradient_checkpointing" in keys and keys["gradient_checkpointing"] is None:
            _parse_bool("gradient_checkpointing", None)  # a written null is refused like any non-bool
        if BACKEND_KEY in keys and keys[BACKEND_KEY] is None:
            _parse_backend(None)  # likewise: None is the field's "not given", not a value to write
        return cls(**keys)

    @classmethod
    def from_json(cls, path: str | os.PathLike[str], *, ignore_unknown: bool = False) -> CheckpointConfig:
        try:
            with open(path, encoding="utf-8") as file:
                text = file.read()
        except UnicodeDecodeError as exc:
            raise ValueError(f"gradseam config file {os.fspath(path)!r} is not UTF-8 text: {exc}") from None
        duplicates = _Duplicates()
        try:
            data = json.loads(text, object_pairs_hook=duplicates, parse_int=_json_int)
        except (json.JSONDecodeError, RecursionError) as exc:  # RecursionError: nesting too deep
            raise ValueError(f"gradseam config file {os.fspath(path)!r} is not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ValueError(
                f"gradseam config file {os.fspath(path)!r} must hold a JSON object of keys, "
                f"got {type(data).__name__}."
            )
        _check_json(os.fspath(path), data, duplicates)
        return cls.from_dict(data, ignore_unknown=ignore_unknown)

    @classmethod
    def coerce(
        cls, value: CheckpointConfig | Mapping[str, Any] | str | os.PathLike[str] | None = None, **kwargs: Any
    ) -> CheckpointConfig:
        """Accept what ``patch`` accepts: a config, a mapping, a JSON file path, or keyword arguments.

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
        if isinstance(value, (str, os.PathLike)):
            if isinstance(value, str) and value.lstrip().startswith("{") and not os.path.exists(value):
                raise ValueError(
                    "gradseam: a str config is read as the path of a JSON file, but this one looks like JSON "
                    "text; pass json.loads(text) instead."
                )
            value = cls.from_json(value)
        if isinstance(value, CheckpointConfig):
            if kwargs:
                return cls.from_dict({**asdict(value), **kwargs})  # unknown kwargs get the key suggestion
            return value
        if value is None:
            return cls.from_dict(kwargs)
        if not isinstance(value, Mapping):
            raise _config_type_error(value)
        return cls.from_dict({**value, **kwargs})

    def to_dict(self) -> dict[str, Any]:
        """The keys as a trainer would write them (JSON-ready)."""
        return asdict(self)

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
        return ", ".join(parts)
