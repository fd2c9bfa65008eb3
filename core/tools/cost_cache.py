"""What each per-block candidate costs on one model, inputs and GPU, kept on disk so a run does not re-measure.

The key is everything that changes a measurement and nothing that does not: the model's class and config,
its block lists (classes and counts), the inputs' shapes and dtypes (and plain values, such as a
``return_dict`` flag), the parameters' dtypes and how many of them train (a LoRA's rank changes the
backward), the device's name, and torch's and gradseam's versions. The budgets are not in it: one
table serves every budget. So a row that ran out of memory while measured records the GPU memory it was
measured within (a cap such as ``torch.cuda.set_per_process_memory_fraction``), and a run that may use more
measures it again. A file is ``<directory>/costs/<hash of the key>.json`` and holds its key, so a reader
can see what it is for, and a file whose key does not match (a hash collision, a hand edit) is ignored
rather than trusted.

A table is saved after every candidate measured, marked incomplete until the last: measuring a large model
takes minutes (Wan 14B at 480p: every candidate at two depths of 32k-token blocks), and a run stopped meanwhile
(killed, preempted, interrupted) resumes from the candidates already measured instead of starting over.

The directory is ``$GRADSEAM_CACHE_DIR``, else ``$XDG_CACHE_HOME/gradseam``, else ``~/.cache/gradseam``.
Deleting it costs one measurement on the next run.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .estimates import Estimate, UnitCosts

# Bumped when what a table means changes. 2: a checked plan's pinned figure counts the weights it streams (in 1 it
# did not, so a plan over the host budget by its weights passed; a format-1 file's rows are kept and its checked
# plans dropped, to run again). 3: a streamed count N places its blocks by size (gradseam.planning.spread), so on a
# model whose blocks differ in size "stream N" streams other blocks than it did; a file before 3 keeps every row and
# checked plan but those streaming a count, which are measured again where a budget asks for them. Any other format
# is measured again. 4: the offload engine issues a group's copies together when it closes and keeps the CPU two
# groups ahead of the GPU (gradseam.offload.engine, twenty-eighth session): a row that moves activations to host
# memory steps at another speed than it did (Flux dev 4k on an H100: its forward 211.1 -> 173.6 ms uncapped). A GPU
# file before 4 keeps the rows that move nothing and measures the others again, and runs its checked plans again; a
# CPU file's rows stay (their figure is saved bytes, which the engine does not change). 5: where one pass's own line
# through the fit depths decides a row's peak, the row is measured again at a deeper cut and predicted from the deeper
# pair (gradseam.tools.advise.confirming_depth; Wan 2.1 14B's streamed unsloth-compile: 17.94 GiB predicted, 8.82
# measured). A GPU file before 5 measures its predicted rows again (which line decided is not in the file); its rows
# measured on the model as it is, out of memory or unsupported, and its checked plans (the whole model), stay.
FORMAT = 5
READABLE = {1, 2, 3, 4, 5}


@dataclass
class Table:
    """Each candidate's estimate at the model's depth, or why it has none (``"unsupported: ..."``, ``"OOM ..."``)."""

    candidates: Sequence[tuple[str, Mapping[str, Any]]]
    results: dict[str, Estimate | str]
    static_gib: float  # weights and inputs on the GPU when measured
    depth_note: str
    complete: bool = True  # False while candidates are still being measured (saved after each one)
    # plans run on the whole model before a first step ran them (:func:`gradseam.tools.auto_planner.plan`), by
    # :func:`config_id`: what each took at the real depth, or why it did not run ("OOM ..."); a run reading the
    # table then settles on the same plan without running any of them again
    checked: dict[str, Estimate | str] = field(default_factory=dict)
    # the host link's rate in GiB/s as streaming uses it (gradseam.tools.host_link), measured once for the table:
    # a streamed candidate's step is modelled from it; None where not measured (no CUDA, nothing to stream)
    link_gib_s: float | None = None
    # by label, a uniform candidate's costs moved onto what its plan measured on the whole model, for the rest of one
    # planning (:mod:`gradseam.tools.plan_check`); never saved: a run reading the table replays the same rounds from
    # the rows and the checked plans. Saved (until the thirty-second session), a first run whose three checks all ran
    # slow (four test workers sharing one GPU) left the next run a moved table, whose first plan was one never run:
    # it ran it, where the cache was to answer every plan
    moved: dict[str, Estimate] = field(default_factory=dict)

    def missing(self) -> list[tuple[str, Mapping[str, Any]]]:
        """The candidates not measured yet (an incomplete table's): a resumed run measures only these."""
        return [(label, config) for label, config in self.candidates if label not in self.results]

    def ladder(self) -> list[tuple[str, dict[str, Any]]]:
        return [(label, dict(config)) for label, config in self.candidates if label in self.results]

    def current(self, label: str) -> Estimate | str | None:
        """``label``'s row as this planning sees it: moved onto what its plan measured on the whole model, if it was."""
        return self.moved.get(label) or self.results.get(label)

    def lookup(self, config: Mapping[str, Any]) -> Estimate | str | None:
        """``config``'s estimate, why it has none, or None when it is not a candidate of this table."""
        for label, known in self.candidates:
            if dict(known) == dict(config):
                found = self.current(label)
                return found if found is not None else f"unsupported: {label} was not measured"
        return None

    def add(self, label: str, config: Mapping[str, Any], result: Estimate | str) -> None:
        """A row measured after the table was made (``"auto"`` measures streamed candidates only where a budget
        needs them): saved with the rest, so the next run with the same key reads it."""
        self.candidates = [*self.candidates, (label, dict(config))]
        self.results[label] = result

    def forget_outgrown(self, limit_gib: float) -> list[str]:
        """Drop the rows that ran out of memory while measured within less GPU memory than ``limit_gib`` (see
        :func:`measured_within_gib`): the table serves every budget, and such a row may fit a larger one. A row of
        the ladder is then missing (measured by the next run that can measure); a streamed row added for a budget
        leaves the table (measured again where a budget asks for it). Returns the labels dropped."""
        return self._forget([label for label, result in self.results.items()
                             if (within := measured_within_gib(result)) is not None
                             and within < limit_gib - LIMIT_SLACK_GIB])

    def forget_out_of_memory(self) -> list[str]:
        """Drop every row that ran out of memory while measured, as :meth:`forget_outgrown` drops some: what ``"auto"``
        does when nothing could be measured beside a model's resident weights, before it measures the candidates again
        with the weights in host memory (:class:`gradseam.auto.NoRoomBesideWeights`). Returns the labels dropped."""
        return self._forget([label for label, result in self.results.items()
                             if isinstance(result, str) and result.startswith("OOM")])

    def _forget(self, dropped: list[str]) -> list[str]:
        if dropped:
            from ..config import STREAM_KEY

            for label in dropped:
                del self.results[label]
            self.candidates = [(label, config) for label, config in self.candidates
                               if label not in dropped or not config.get(STREAM_KEY)]
            self.complete = not self.missing()
        return dropped

    def to_json(self, key: Mapping[str, Any]) -> dict[str, Any]:
        return {
            "format": FORMAT, "key": dict(key), "static_gib": self.static_gib, "depth_note": self.depth_note,
            "complete": self.complete,
            "candidates": [{"label": label, "config": dict(config), "result": _result_json(r)}
                           for label, config in self.candidates if (r := self.results.get(label)) is not None],
            # an incomplete table's candidates still to measure, in order
            "to_measure": [{"label": label, "config": dict(config)} for label, config in self.missing()],
            # by id: a plan that ran out of memory is kept as "<config id> under <GPU GiB>" (plan_check), not JSON
            "checked": [{"id": name, "result": _result_json(r)} for name, r in self.checked.items()],
            "link_gib_s": self.link_gib_s,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Table:
        """The table a file holds. A GPU row whose line falls with depth (its deeper step ran faster) is left to
        measure again: :func:`gradseam.tools.advise.depth_measure` now times such a row again and refuses it if it
        still falls, and a file written before kept the line, which predicts the whole model faster than a cut one.
        A CPU table's rows stay (as depth_measure does not time them again there: a CPU row's figure is its saved
        bytes, and a tiny model's step time is noise)."""
        cpu = (data.get("key") or {}).get("device") == "cpu"
        placed_by_size = data.get("format", FORMAT) >= 3
        engine_current = cpu or data.get("format", FORMAT) >= 4
        lines_confirmed = cpu or data.get("format", FORMAT) >= 5
        candidates, results = [], {}
        for item in data["candidates"]:
            if not placed_by_size and streams_a_count(item["config"]):
                continue  # measured with other blocks streamed: measured again where a budget asks for it
            candidates.append((item["label"], dict(item["config"])))
            result = _result(item["result"])
            stale = ((not engine_current and moves_activations(item["config"]))  # timed by the engine before 4
                     or (not lines_confirmed and predicted(result)))  # a pass's line not confirmed deeper before 5
            if (cpu or not falls(result)) and not stale:
                results[item["label"]] = result
        candidates += [(item["label"], dict(item["config"])) for item in data.get("to_measure", ())]
        checked = {}
        if data.get("format") in (2, 3, 4, 5) and engine_current:
            checked = {item["id"]: _result(item["result"]) for item in data.get("checked", ())
                       if placed_by_size or not _id_streams_a_count(item["id"])}
        complete = bool(data.get("complete", True)) and len(results) == len(candidates)
        link = data.get("link_gib_s")
        return cls(candidates, results, float(data["static_gib"]), str(data["depth_note"]), complete, checked,
                   float(link) if link else None)


def predicted(result: Estimate | str) -> bool:
    """Whether a row's figures were predicted from cut models (not measured on the model as it is, nor a failure)."""
    return isinstance(result, Estimate) and result.source.startswith("predicted")


def streams_a_count(config: Mapping[str, Any]) -> bool:
    """Whether ``config`` streams a number of blocks (which ones: :func:`gradseam.planning.spread`), at the top level
    or in an entry of ``gradient_checkpointing_blocks``; ``"all"`` streams the same blocks whatever the placement."""
    from ..config import BLOCKS_KEY, STREAM_KEY

    values = [config.get(STREAM_KEY)] + [dict(entry).get(STREAM_KEY) for entry in config.get(BLOCKS_KEY) or ()]
    return any(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values)


def moves_activations(config: Mapping[str, Any]) -> bool:
    """Whether ``config`` moves activations to host memory (an ``unsloth`` backend or attention offload), so that its
    step time is the offload engine's: the candidates are uniform rows, read at the top level."""
    from ..config import CheckpointConfig
    from ..spec import strategy_of

    try:
        return bool(strategy_of(CheckpointConfig.coerce(dict(config))).destinations)
    except ValueError:  # CheckpointConfig's error for a key or value it does not know
        return True  # not a config this version reads: measure it again rather than trust its figures


def _id_streams_a_count(name: str) -> bool:
    """:func:`streams_a_count` for a checked plan's id (its config as :func:`config_id` wrote it, perhaps followed by
    `` under <GiB>`` for one that ran out of memory)."""
    text = name.split(" under ")[0] if name.endswith(" GiB") else name
    try:
        return streams_a_count(json.loads(text))
    except ValueError:
        return True  # not a config this reader can read: run it again


# a limit read again within this of the one a row was measured within is the same limit (it is written to 0.01 GiB)
LIMIT_SLACK_GIB = 0.01
_OOM = "OOM while measuring"
_WITHIN = re.compile(rf"{_OOM} within (\d+(?:\.\d+)?) GiB")


def oom_while_measuring(what: str, within_gib: float | None) -> str:
    """A row's result when it ran out of memory while measured, with the GPU memory it was measured within (None:
    off a GPU), as :func:`measured_within_gib` reads it back."""
    return f"{_OOM}{f' within {within_gib:.2f} GiB' if within_gib is not None else ''}: {what}"


_BEGAN = re.compile(r"; (\d+(?:\.\d+)?) GiB allocated when its step began\)$")


def began_note(began_gib: float | None) -> str:
    """What a cached failure says of the GPU memory allocated when its step began (``"; 0.62 GiB allocated when its
    step began"``, read back by :func:`began_gib`), or nothing where that is not known."""
    return f"; {began_gib:.2f} GiB allocated when its step began" if began_gib is not None else ""


def began_gib(result: Estimate | str) -> float | None:
    """The GiB a cached failure (``oom_while_measuring("... (at ...{began_note})")``) says were allocated when its step
    began, or None where it does not say."""
    found = _BEGAN.search(result) if isinstance(result, str) else None
    return float(found.group(1)) if found else None


def measured_within_gib(result: Estimate | str) -> float | None:
    """The GPU memory a row that ran out of memory while measuring was measured within (in GiB, as
    :mod:`gradseam.tools.auto_planner` writes it), or None: a row that fitted, failed otherwise, or was written before
    the limit was recorded (such a row is kept as it was)."""
    found = _WITHIN.match(result) if isinstance(result, str) else None
    return float(found.group(1)) if found else None


def falls(result: Estimate | str) -> bool:
    """Whether ``result``'s step time fell with depth (its line through two depths gives each unit no time). A row
    whose costs were moved onto what the whole model took (:func:`gradseam.tools.plan_check.measured_costs`) is a
    measurement, whatever its per-unit split: on a tiny model the line's fixed part can exceed the whole step."""
    return isinstance(result, Estimate) and result.source.startswith("predicted") \
        and result.unit_costs is not None and result.unit_costs.step_ms <= 0


def config_id(config: Mapping[str, Any]) -> str:
    """One string per config, whatever the order of its keys: how :attr:`Table.checked` finds a plan."""
    return json.dumps(dict(config), sort_keys=True, default=str)


def _result_json(result: Estimate | str) -> Any:
    return asdict(result) if isinstance(result, Estimate) else result


def _result(data: Any) -> Estimate | str:
    if isinstance(data, Mapping):
        units = data.get("unit_costs")
        return Estimate(**{**data, "unit_costs": UnitCosts(**units) if units else None})
    return data


def directory(override: str | os.PathLike[str] | None = None) -> Path:
    if override is not None:
        return Path(override)
    if os.environ.get("GRADSEAM_CACHE_DIR"):
        return Path(os.environ["GRADSEAM_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "gradseam"


def key_of(request: Any, candidates: Sequence[tuple[str, Mapping[str, Any]]]) -> dict[str, Any]:
    """The cache key of ``request`` (a :class:`gradseam.auto.Request`): see the module docstring."""
    import torch

    import gradseam

    from ..modules import resolve

    model = request.model
    blocks = {}
    for block_list in request.family.block_lists:
        found = resolve(model, block_list.path)
        if found is not None:
            blocks[block_list.path] = [len(found), sorted({type(b).__name__ for b in found})]
    params = list(model.parameters())
    device = next((p.device for p in params), torch.device("cpu"))
    return {
        "model": f"{type(model).__module__}.{type(model).__qualname__}",
        "family": request.family.name,
        "config": _plain(dict(getattr(model, "config", {}) or {})),
        "blocks": blocks,
        "inputs": {name: _describe(value) for name, value in sorted(request.inputs.items())},
        "dtypes": sorted({str(p.dtype) for p in params}),
        "trainable": sum(p.numel() for p in params if p.requires_grad),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
        "torch": torch.__version__,
        "gradseam": gradseam.__version__,
        "candidates": [label for label, _ in candidates],
    }


def _describe(value: Any) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        return {"shape": list(value.shape), "dtype": str(value.dtype), "grad": value.requires_grad}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_describe(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _describe(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    return type(value).__name__


def _plain(value: Any) -> Any:
    """``value`` as JSON can hold it, deterministically (a diffusers config has tuples, dtypes, nested dicts)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0])) if not str(k).startswith("_")}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return str(value)


def _path(key: Mapping[str, Any], override: str | os.PathLike[str] | None) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return directory(override) / "costs" / f"{digest}.json"


def load(key: Mapping[str, Any], override: str | os.PathLike[str] | None = None) -> Table | None:
    """The table cached for ``key``, or None (none, unreadable, a format not in :data:`READABLE` or another key)."""
    path = _path(key, override)
    try:
        data = json.loads(path.read_text())
        if data.get("format") not in READABLE or data.get("key") != json.loads(json.dumps(key)):
            return None
        return Table.from_json(data)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def save(key: Mapping[str, Any], table: Table, override: str | os.PathLike[str] | None = None) -> Path | None:
    """Write ``table`` for ``key`` (atomically: a reader never sees half a file); None if it cannot be written,
    which costs a measurement next time, never the run."""
    path = _path(key, override)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(table.to_json(key), indent=1, sort_keys=True))
        os.replace(tmp, path)
    except OSError:
        return None
    return path
