"""Where streamed blocks go: a model of the forward's copy stream, the even spread against placement by size.

``python docs/scripts/stream_placement.py [--link-gib-s 49.5] [--block-ms 3.0] [--doubles 19 --double-gib 0.633]
[--singles 38 --single-gib 0.262] [--prefetch 1]`` prints, for each count of streamed blocks, the GPU memory the
streaming frees (the streamed weights less the most that are on the GPU at once) and the forward's time in the model,
for blocks placed evenly by position (gradseam before the twenty-third session) and by size
(:func:`gradseam.planning.spread` now). The defaults are Flux dev at 4,096 tokens on an H100: the blocks' bf16 weights,
~3 ms of forward compute each (170.4 ms for 57 blocks, measured), and the link's rate as ``auto``'s ``compile + stream
31`` moved its weights in its forward (11.87 GiB in 239.9 ms).

Why a model and not only a benchmark: the placement decides which blocks' copies can hide behind compute, and the
forward is where that shows (its copies have a third of the step's compute to hide behind, the backward's two thirds).
Checked against the measurement it explains: the even spread's ``stream 25`` forward, 222 ms modelled, 226.0 ms
measured on the H100 (docs/benchmarks.md, "Each row in its own process").

The model: blocks run in forward order, each taking ``block_ms``; one copy stream moves streamed blocks' weights in
order, each at ``link_gib_s``; a streamed block's copy is issued when the streamed block ``prefetch`` places before it
starts (the first when the forward starts), and a streamed block starts once its copy is done. That is what
:mod:`gradseam.offload.weights` does; what it leaves out (kernel launch gaps, the activations' own copies) moves both
placements alike. ``auto`` predicts a streamed candidate's step with the same model
(:mod:`gradseam.tools.host_link`), forward and backward.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence


def forward_ms(streamed: Sequence[int], sizes: Sequence[float], block_ms: float, link_gib_s: float,
               prefetch: int = 1) -> float:
    """The forward's time when the blocks at ``streamed`` (forward order) stream: the model ``auto`` plans with
    (:func:`gradseam.tools.host_link.pass_ms`), every block taking ``block_ms``."""
    from gradseam.tools.host_link import pass_ms

    return pass_ms([block_ms] * len(sizes), sizes, streamed, link_gib_s, prefetch)


def freed_gib(streamed: Sequence[int], sizes: Sequence[float], prefetch: int = 1) -> float:
    """The streamed weights less the most of them on the GPU at once (the running block and those copied ahead)."""
    from gradseam.tools.advise import most_at_once

    chosen = [sizes[i] for i in sorted(streamed)]
    return sum(chosen) - most_at_once(chosen, prefetch)


def even(count: int, total: int) -> list[int]:
    """The placement by position that gradseam used before: each of ``count`` equal shares' middle block."""
    return [((2 * k + 1) * total) // (2 * count) for k in range(count)]


def main(argv: Sequence[str] | None = None) -> list[dict[str, float]]:
    from gradseam.planning import spread

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--link-gib-s", type=float, default=49.5)
    parser.add_argument("--block-ms", type=float, default=3.0)
    parser.add_argument("--doubles", type=int, default=19)
    parser.add_argument("--double-gib", type=float, default=0.633)
    parser.add_argument("--singles", type=int, default=38)
    parser.add_argument("--single-gib", type=float, default=0.262)
    parser.add_argument("--prefetch", type=int, default=1)
    args = parser.parse_args(argv)
    sizes = [args.double_gib] * args.doubles + [args.single_gib] * args.singles
    compute = args.block_ms * len(sizes)
    rows = []
    print(f"forward compute {compute:.0f} ms; link {args.link_gib_s} GiB/s; prefetch {args.prefetch}")
    print("| streamed | even: freed GiB | even: forward ms | by size: freed GiB | by size: forward ms |")
    print("|---:|---:|---:|---:|---:|")
    for count in range(2, len(sizes) + 1, 2):
        placements = {"even": even(count, len(sizes)), "size": spread(count, sizes)}
        row = {"count": count}
        for name, chosen in placements.items():
            row[f"{name}_freed_gib"] = freed_gib(chosen, sizes, args.prefetch)
            row[f"{name}_forward_ms"] = forward_ms(chosen, sizes, args.block_ms, args.link_gib_s, args.prefetch)
        rows.append(row)
        print(f"| {count} | {row['even_freed_gib']:.2f} | {row['even_forward_ms']:.0f} | {row['size_freed_gib']:.2f} "
              f"| {row['size_forward_ms']:.0f} |")
    return rows


if __name__ == "__main__":
    main()
