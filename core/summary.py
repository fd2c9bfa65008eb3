"""What a patch did, as rows a person can read (``print(handle.summary())``) or a program can use."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .backends import Destination, Kept, Offload
from .kinds import KINDS
from .spec import Plan, RegionSpec, Shape

if TYPE_CHECKING:
    from .run.chains import ChainStats


@dataclass(frozen=True)
class RegionView:
    """One region a handle installed, as tools and tests may read it (``handle.regions()``).

    The first fields are the plan's spec (what the region is and how it runs); the rest count how
    it ran. ``calls`` counts, per member module, the calls made with gradients enabled (for an
    attention-offload region: the offloaded calls of its submodule); ``runs`` the checkpoint regions
    computed (a whole chunk counts once); ``chunk_calls`` the calls that ran a whole chunk and
    ``served`` the later members answered from it; ``fallbacks`` maps each reason a member had to
    compute on its own (or a kept kernel output had to be computed again) to how often it happened;
    ``notes`` the same for ways a call ran as planned that are worth telling (a compiled block whose
    attention ran outside its graph). ``kind`` names the region's kind (:data:`gradseam.kinds.KINDS`:
    "whole-block", "ffn-seam", "compiled-block", "attention-offload"), ``shape`` what it covers (a block, a chunk, an FFN
    seam, an attention submodule).
    """

    list_path: str
    blocks: tuple[int, ...]
    shape: Shape
    block_class: str
    seam: tuple[str, ...]
    calls: tuple[int, ...] = ()
    runs: int = 0
    chunk_calls: int = 0
    served: int = 0
    fallbacks: Mapping[str, int] = field(default_factory=dict)
    notes: Mapping[str, int] = field(default_factory=dict)
    kind: str = ""
    offload: Offload = Offload.NOTHING
    destination: Destination = Destination.DEVICE
    kept: Kept = Kept.NOWHERE

    @classmethod
    def of(cls, spec: RegionSpec, stats: ChainStats | None) -> RegionView:
        s = stats
        return cls(
            spec.list_path, spec.blocks, spec.shape, spec.block_class, spec.seam,
            calls=tuple(s.member_calls) if s else (), runs=s.runs if s else 0,
            chunk_calls=s.chunk_calls if s else 0, served=s.served if s else 0,
            fallbacks=dict(s.fallbacks) if s else {}, notes=dict(s.notes) if s else {}, kind=spec.kind.name,
            offload=spec.offload, destination=spec.destination, kept=spec.kept,
        )

    @property
    def label(self) -> str:
        return f"{self.list_path}{list(self.blocks)}" + (f".{'→'.join(self.seam)}" if self.seam else "")

    @property
    def ran(self) -> bool:
        return bool(self.calls) and self.calls[0] > 0

    @property
    def whole(self) -> bool:
        """Every call of the region computed it as one region (a chunk's later members were served)."""
        first = self.calls[0] if self.calls else 0
        return not self.fallbacks and self.runs == first and all(c == first for c in self.calls)


@dataclass(frozen=True)
class Row:
    component: str
    blocks: str  # e.g. "transformer_blocks[0..1]"
    block_class: str
    strategy: str


def _span(path: str, indices: tuple[int, ...]) -> str:
    if len(indices) == 1:
        return f"{path}[{indices[0]}]"
    return f"{path}[{indices[0]}..{indices[-1]}]"


class Summary:
    def __init__(self, title: str, rows: list[Row], notes: list[str] | None = None) -> None:
        self.title = title
        self.rows = rows
        self.notes = notes or []  # how regions have run so far: chunk fallbacks, pending offload

    @classmethod
    def of(cls, plan: Plan, views: tuple[RegionView, ...], *, pending: bool = False, model_name: str = "",
           component: str = "", device: str = "cuda") -> Summary:
        """The rows of one patched model: its plan's specs, and notes from how the regions ran.

        ``device``: the model's device type; what stays on it is worded by it ("GPU memory" on a CUDA
        model, "CPU memory" on a CPU one)."""
        merged: dict[tuple[str, tuple[int, ...]], list[str]] = {}
        classes: dict[tuple[str, tuple[int, ...]], str] = {}
        for region in plan.regions:
            what = describe(region, pending=pending, device=device)
            if region.shape in (Shape.BLOCK, Shape.CHUNK):
                for i in region.blocks:
                    key = (region.list_path, (i,))
                    classes[key] = region.block_class
                    merged.setdefault(key, []).append(what)
                continue
            key = (region.list_path, region.blocks)
            classes[key] = region.block_class
            merged.setdefault(key, []).append(what)
        for path, index, block_class in plan.plain:
            key = (path, (index,))
            classes[key] = block_class
            merged.setdefault(key, []).append(f"none (activations kept on {memory_of(device)})")
        rows = []
        # Collapse consecutive blocks with the same strategy into one row.
        paths = [bl.path for bl in plan.family.block_lists]
        ordered = sorted(merged, key=lambda k: (paths.index(k[0]) if k[0] in paths else len(paths), k[1]))
        run: list[tuple[str, tuple[int, ...]]] = []

        def emit() -> None:
            if run:
                first, last = run[0], run[-1]
                span = _span(first[0], (first[1][0], last[1][-1])) if len(run) > 1 else _span(*first)
                rows.append(Row(component, span, classes[first], "; ".join(merged[first])))
                run.clear()

        for key in ordered:
            if run and (run[-1][0] != key[0] or merged[run[-1]] != merged[key] or key[1][0] != run[-1][1][-1] + 1):
                emit()
            run.append(key)
        emit()
        notes = [note for name, kind in KINDS.items() for note in kind.notes([r for r in views if r.kind == name])]
        notes += _ran_notes([r for r in views if r.notes])
        if pending:
            notes.append(f"offload pending: {model_name or 'the model'} is on the CPU; offloading starts "
                         "once it is on a GPU")
        return cls(f"{plan.family.name}: {plan.config.describe()}", rows, [f"{component}: {n}" if component else n
                                                                        for n in notes])

    @classmethod
    def merge(cls, parts: dict[str, Summary]) -> Summary:
        rows = [Row(name, r.blocks, r.block_class, r.strategy) for name, part in parts.items() for r in part.rows]
        notes = [f"{name}: {n}" for name, part in parts.items() for n in part.notes]
        return cls("; ".join(f"{n}: {p.title}" for n, p in parts.items()), rows, notes)

    def __str__(self) -> str:
        headers = ("component", "blocks", "class", "strategy")
        body = [(r.component, r.blocks, r.block_class, r.strategy) for r in self.rows]
        if not any(r.component for r in self.rows):
            headers, body = headers[1:], [b[1:] for b in body]
        widths = [max(len(str(x)) for x in col) for col in zip(headers, *body)]
        line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
        out = [self.title, line(headers), line("-" * w for w in widths)]
        out += [line(b) for b in body]
        out += [f"note: {n}" for n in self.notes]
        return "\n".join(out)

    __repr__ = __str__


def _ran_notes(regions: list[RegionView]) -> list[str]:
    """One note per way regions ran as planned but worth telling, summed over the regions it applies to."""
    by_note: dict[str, list[int]] = {}
    for r in regions:
        for note, n in r.notes.items():
            count = by_note.setdefault(note, [0, 0])
            count[0] += 1
            count[1] += n
    return [f"{blocks} region(s), from {next(r.label for r in regions if note in r.notes)}: {calls} call(s) with {note}"
            for note, (blocks, calls) in by_note.items()]


def memory_of(device: str) -> str:
    """The words for a device type's memory: ``cuda`` -> "GPU", ``cpu`` -> "CPU", ``mps`` -> "MPS"."""
    return {"cuda": "GPU", "cpu": "CPU"}.get(device, device.upper())


def describe(region: RegionSpec, *, pending: bool = False, device: str = "cuda") -> str:
    """What a region does, in words, from its spec and its kind; what stays on the model's device is worded
    by ``device`` (its type: "cuda", "cpu")."""
    later = " (pending: the model is on the CPU)" if pending and region.moves else ""
    return region.kind.describe(region, own=memory_of(device), later=later)
