"""What a patch did, as rows a person can read (``print(handle.summary())``) or a program can use."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .patcher import PatchHandle, RegionView


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
    def of(cls, handle: PatchHandle, component: str = "") -> Summary:
        cfg = handle.config
        pending = handle.offload_pending()
        where = " (pending: the model is on the CPU)" if pending else ""
        backend = cfg.backend_spec
        merged: dict[tuple[str, tuple[int, ...]], list[str]] = {}
        classes: dict[tuple[str, tuple[int, ...]], str] = {}
        for region in handle.plan.regions:
            if region.kind in ("block", "chunk"):
                unit = f"chunks of {len(region.blocks)} blocks" if region.kind == "chunk" else "each block"
                what = backend.describe(unit, kernels=cfg.kept_kernels, pending=pending)
                for i in region.blocks:
                    key = (region.list_path, (i,))
                    classes[key] = region.block_class
                    merged.setdefault(key, []).append(what)
                continue
            key = (region.list_path, region.blocks)
            classes[key] = region.block_class
            if region.kind == "ffn":
                merged.setdefault(key, []).append(backend.describe("→".join(region.seam), pending=pending))
            else:
                merged.setdefault(key, []).append(f"offload {region.seam[0]} saved tensors{where}")
        for path, index, block_class in handle.plan.plain:
            key = (path, (index,))
            classes[key] = block_class
            merged.setdefault(key, []).append("none (activations kept on GPU)")
        rows = []
        # Collapse consecutive blocks with the same strategy into one row.
        ordered = sorted(merged, key=lambda k: (_list_order(handle, k[0]), k[1]))
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
        notes = [_fallback_note(r) for r in handle.regions() if r.fallbacks]
        if pending:
            notes.append(f"offload pending: {type(handle.model).__name__} is on the CPU; offloading starts "
                         "once it is on a GPU")
        return cls(f"{handle.family.name}: {cfg.describe()}", rows, [f"{component}: {n}" if component else n
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


def _fallback_note(region: RegionView) -> str:
    fell = sum(region.fallbacks.values())
    calls = region.calls[0] if region.calls else 0
    why = "; ".join(f"{n}x {cause}" for cause, n in sorted(region.fallbacks.items(), key=lambda kv: -kv[1]))
    return (f"{region.label}: ran as one chunk {region.chunk_calls} of {calls} calls; {fell} call(s) "
            f"fell back to one region per block because {why}")


def _list_order(handle: PatchHandle, path: str) -> int:
    paths = [bl.path for bl in handle.family.block_lists]
    return paths.index(path) if path in paths else len(paths)
