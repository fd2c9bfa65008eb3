"""gradseam under FSDP2: ``fully_shard`` per block, every strategy, checked and measured.

Two jobs, each run with one process per GPU (``torchrun``)::

    # gradients and loss of one data-parallel step vs a single-GPU reference (fp32, smaller config)
    torchrun --nproc-per-node 2 docs/scripts/fsdp2.py check --family flux --layers 2 --tokens 1024
    # peak memory per GPU and step time per strategy (bf16, full fine-tune, AdamW)
    torchrun --nproc-per-node 2 docs/scripts/fsdp2.py bench --family flux --layers 8 --json fsdp2.json
    # the chart of one or more bench results (no GPU needed)
    python docs/scripts/fsdp2.py chart fsdp2-2gpu.json fsdp2-1gpu.json --png fsdp2.png

``--cpu`` runs either job over gloo on the CPU; ``--tiny`` swaps the preset for a tiny Flux, so the
check runs in seconds there (the test suite does exactly that). On the CPU the offload strategies
run through :func:`gradseam.offload.cpu_test_mode`.

Why it is set up this way:

* gradseam patches first, then every block and the root are ``fully_shard``-ed: the block's
  ``forward`` is gradseam's, FSDP's all-gather/reshard hooks wrap it from the outside, and in
  backward FSDP's pre-backward all-gather runs before the recompute needs the weights.
* The check gives each rank a *different* batch and compares the sharded gradients (gathered with
  ``full_tensor``) with the mean of both batches' gradients on one unsharded GPU, so the
  reduce-scatter really contributes. It runs in fp32 with TF32 off and the math attention kernel,
  so the only differences left are summation order: the unpatched FSDP2 run is the control row.
* The rows "FSDP2, no checkpointing" and "FSDP2 + its own AC" (torch's composable ``checkpoint``
  on every block, what FSDP2 recipes apply) are measured in the same process, on the same inputs.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import faulthandler
import gc
import json
import os
import warnings
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import gradseam
from gradseam.backends import Kept
from gradseam.errors import GradseamWarning
from gradseam.family import Preset
from gradseam.offload import cpu_test_mode
from gradseam.tools import measure, workloads
from gradseam.tools.named_strategies import BY_LABEL, kept_kernel_variants, rows_of, select

OWN_AC = "fsdp-ac"
# gradseam's rows, from the named strategies, least aggressive first: each way of patching once, under
# FSDP2's hooks: every backend and variant that checkpoints every block, at the default memory budget
# (another budget is the compiler's matter, not FSDP2's), kept kernel outputs where their backend keeps
# what it saves (one on the device, one in CPU memory)
GRADSEAM_ROWS = [s for s in select(patches=True, strided=False, budget=None)
                 if s.kept is Kept.NOWHERE or s in kept_kernel_variants()]
# (label, gradseam config | None | OWN_AC)
ROWS: list[tuple[str, Any]] = [
    ("FSDP2, no checkpointing", None),
    ("FSDP2 + its own AC (checkpoint per block)", OWN_AC),
    *rows_of(GRADSEAM_ROWS),
]
# Rel. L2 error allowed per gradient in fp32: the unpatched FSDP2 run differs from one GPU by
# ~1e-7 (reduction order); a wrong region (lost argument, wrong weights) is off by >1e-2.
TOLERANCE = 1e-5

TINY_FLUX = {
    "in_channels": 4, "num_layers": 2, "num_single_layers": 3, "attention_head_dim": 8, "num_attention_heads": 2,
    "joint_attention_dim": 16, "pooled_projection_dim": 8, "axes_dims_rope": [2, 2, 4],
}


def setup(cpu: bool) -> tuple[torch.device, Any]:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if cpu:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=world)
        device = torch.device("cpu")
    else:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
    return device, init_device_mesh(device.type, (world,))


def build(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> workloads.Workload:
    family = workloads.find_family(args.family)
    preset = args.preset
    if args.tiny:
        base = family.presets[next(iter(family.presets))]
        family = dataclasses.replace(
            family, presets={"tiny": Preset("tiny Flux", TINY_FLUX, {"image_tokens": 16, "text_tokens": 8},
                                            base.make_inputs)}
        )
        preset = "tiny"
    work = workloads.build(family, preset, layers=args.layers, device=device, dtype=dtype, seed=0)
    work.model.requires_grad_(True)  # full fine-tune: FSDP2 reduce-scatters every gradient
    return work


def batch(work: workloads.Workload, tokens: int | None, seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    p = work.preset
    assert p.make_inputs is not None
    return dict(p.make_inputs(work.model, work.device, work.dtype, tokens, **p.inputs))


def shard(model: nn.Module, work: workloads.Workload, mesh: Any, config: Any) -> Any:
    """gradseam (or FSDP's own AC) first, then ``fully_shard`` on every block and the root."""
    handle = None
    blocks = workloads.blocks(model, work.family)
    if config == OWN_AC:
        from torch.distributed._composable import checkpoint

        for block in blocks:
            checkpoint(block)
    elif config is not None:
        with cpu_test_mode() if work.device.type == "cpu" else nullcontext():
            handle = gradseam.patch(model, config)
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return handle


def loss_of(model: nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
    return measure.default_loss(model(**inputs))


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


# -- check --------------------------------------------------------------------------------------


def rows_to_check(leave_out: list[str]) -> list[tuple[str, Any]]:
    """ROWS without those labelled in ``leave_out`` (``--leave-out``): each must be a row's label, and not the first
    (FSDP2 alone, every row's control)."""
    if ROWS[0][0] in leave_out:
        raise SystemExit(f"--leave-out: {ROWS[0][0]!r} is every row's control; it always runs")
    unknown = sorted(set(leave_out) - {label for label, _ in ROWS})
    if unknown:
        raise SystemExit(f"--leave-out: no row is labelled {', '.join(map(repr, unknown))}; the rows: "
                         f"{', '.join(label for label, _ in ROWS)}")
    return [(label, config) for label, config in ROWS if label not in leave_out]


def check(args: argparse.Namespace) -> int:
    device, mesh = setup(args.cpu)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    from torch.nn.attention import SDPBackend, sdpa_kernel

    work = build(args, device, torch.float32)
    # On the GPU math attention keeps the fp32 comparison deterministic; on the CPU the default (flash
    # for CPU) is deterministic already, and it is an attention *kernel*, which the kept-attention rows keep.
    kernel = SDPBackend.MATH if device.type == "cuda" else [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]
    pristine = copy.deepcopy(work.model)
    batches = [batch(work, args.tokens, 100 + r) for r in range(world)]
    # The single-GPU reference: mean loss and mean gradient over every rank's batch, unsharded.
    ref_loss = 0.0
    with sdpa_kernel(kernel):
        for inputs in batches:
            loss = loss_of(work.model, inputs)
            loss.backward()
            ref_loss += loss.item() / world
        ref_grads = {n: p.grad / world for n, p in work.model.named_parameters() if p.grad is not None}
    failures, report, control = 0, [], None
    rows = rows_to_check(args.leave_out)
    for label, config in rows:
        model = copy.deepcopy(pristine)
        handle = shard(model, work, mesh, config)
        with sdpa_kernel(kernel), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loss = loss_of(model, batches[rank])
            loss.backward()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        mean_loss = mean_loss.item() / world
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
        control = control if control is not None else grads  # the first row: FSDP2 without gradseam
        worst, where = max((rel_l2(g, ref_grads[n]), n) for n, g in grads.items())
        vs_control = max(rel_l2(g, control[n]) for n, g in grads.items())
        loss_err = abs(mean_loss - ref_loss) / abs(ref_loss)
        moved = handle.engine.stats()["offloaded_bytes"] if handle is not None and handle.engine else 0
        # gradseam's checkpoint regions that ran in this step, of those it planned (its attention seams count no
        # calls), and whether the model kept its handle through fully_shard: None for the rows without gradseam
        runs = [r for r in handle.regions() if r.shape != "attention"] if handle is not None else None
        ran = [sum(r.ran for r in runs), len(runs)] if runs is not None else None
        kept = gradseam.handle_of(model) is handle if handle is not None else None
        ok = grads.keys() == ref_grads.keys() and worst < TOLERANCE and loss_err < TOLERANCE
        if isinstance(config, dict):
            ok = ok and len(handle.plan.regions) > 0
            if BY_LABEL[label].strategy.destinations:
                ok = ok and moved > 0  # offload configs really moved activations
        failures += not ok
        notes = sorted({str(w.message).split(";")[0] for w in caught if issubclass(w.category, GradseamWarning)})
        report.append({"strategy": label, "max_grad_rel_l2": worst, "worst_param": where,
                       "max_grad_rel_l2_vs_fsdp2_unpatched": vs_control, "loss_rel": loss_err,
                       "offloaded_bytes": moved, "regions_ran": ran, "handle_kept": kept, "warnings": notes,
                       "ok": ok})
        if rank == 0:
            print(f"{'ok  ' if ok else 'FAIL'} {label:42s} grad rel L2 max {worst:.2e} ({where}), "
                  f"vs FSDP2 unpatched {vs_control:.1e}, loss rel {loss_err:.1e}, offloaded {moved / 2**20:.2f} MiB",
                  flush=True)
            for note in notes:
                print(f"     warning: {note}", flush=True)
        if handle is not None:
            handle.remove()
        del model, handle
        release(device)
    if rank == 0:
        print(f"{len(rows) - failures}/{len(rows)} strategies match the single-device reference "
              f"(world size {world}, tolerance {TOLERANCE:g})", flush=True)
        if args.json:
            meta = {"job": "check", "world_size": world, "family": args.family, "layers": args.layers,
                    "tokens": args.tokens, "tiny": args.tiny, "device": device.type, "reference_loss": ref_loss}
            with open(args.json, "w") as f:
                json.dump({**meta, "rows": report}, f, indent=1)
    dist.destroy_process_group()
    return 1 if failures else 0


# -- bench --------------------------------------------------------------------------------------


@dataclasses.dataclass
class Timing:
    status: str = "ok"
    step_ms: float | None = None  # median over the timed steps: forward + backward + AdamW step
    activation_gib: float | None = None  # forward + backward peak minus the allocation before it
    peak_gib: float | None = None  # the whole step's max_memory_allocated (weights, states, all)


def timed(model: nn.Module, inputs: dict[str, Any], steps: int, device: torch.device) -> Timing:
    """One rank's numbers. The forward+backward peak is read before ``opt.step()``: AdamW's
    foreach temporaries (several times the shard) would otherwise hide every difference."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, foreach=True)
    cuda = device.type == "cuda"
    calls, fwd_bwd = [0], [0]

    def step() -> int:
        calls[0] += 1
        dist.barrier()
        loss_of(model, inputs).backward()
        if cuda and calls[0] > 1:  # the first call is the warm-up (optimizer states, pinned pool, allocator)
            fwd_bwd[0] = max(fwd_bwd[0], torch.cuda.max_memory_allocated())
        opt.step()
        opt.zero_grad(set_to_none=True)
        return 0

    try:
        got = measure.measure(step, steps=steps, warmup=1, device=device.type)
    except torch.OutOfMemoryError:
        return Timing("OOM")
    if not cuda:
        return Timing(step_ms=got.step_ms)
    return Timing("ok", got.step_ms, fwd_bwd[0] / 2**30 - got.base_gib, got.peak_gib + got.base_gib)


def worst(per_rank: list[dict[str, Any]], key: str) -> float | None:
    values = [g[key] for g in per_rank if g[key] is not None]
    return max(values) if values else None


def release(device: torch.device) -> None:
    """FSDP2 modules sit in reference cycles: collect them now, not rows later."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def bench(args: argparse.Namespace) -> int:
    device, mesh = setup(args.cpu)
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = torch.float32 if args.cpu else torch.bfloat16
    work = build(args, device, dtype)
    pristine = work.model.to("cpu")  # each row shards a fresh copy; the GPU holds one row at a time
    release(device)
    inputs = batch(work, args.tokens, 100 + rank)
    # "none" runs first and again last: the two show how stable the machine was over the sweep.
    rows_to_run = [r for r in ROWS if not (isinstance(r[1], dict) and r[1].get("gradient_checkpointing_interval"))]
    rows_to_run.append(("FSDP2, no checkpointing (again, last)", None))
    rows = []
    for label, config in rows_to_run:
        model = copy.deepcopy(pristine).to(device)
        handle = shard(model, work, mesh, config)
        engine = handle.engine if handle is not None else None
        timing = timed(model, inputs, args.steps, device)
        moved = engine.offloaded_bytes / (args.steps + 1) / 2**20 if engine is not None else 0.0
        if handle is not None:
            handle.remove()
        del model, handle
        release(device)
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, {**dataclasses.asdict(timing), "offloaded_mib": moved})
        if rank == 0:
            row = {"strategy": label, "status": "OOM" if any(g["status"] == "OOM" for g in gathered) else "ok",
                   **{key: worst(gathered, key) for key in ("step_ms", "activation_gib", "peak_gib", "offloaded_mib")}}
            rows.append(row)
            print(json.dumps(row), flush=True)
    if rank == 0:
        none = rows[0]["step_ms"]
        for row in rows:
            row["vs_none"] = round(row["step_ms"] / none, 3) if row["step_ms"] and none else None
        meta = {"job": "bench", "world_size": world, "family": work.family.name, "preset": work.preset_name,
                "layers": work.layers_note, "tokens": args.tokens, "steps": args.steps,
                "dtype": str(dtype), "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                "torch": torch.__version__,
                "per_gpu": "max over ranks; activation_gib = forward+backward peak minus the allocation before it"}
        print(markdown(meta, rows), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({**meta, "rows": rows}, f, indent=1)
            if device.type == "cuda":
                chart([{**meta, "rows": rows}], os.path.splitext(args.json)[0] + ".png")
    dist.destroy_process_group()
    return 0


def markdown(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    def num(v: float | None, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    lines = [f"{meta['family']} {meta['preset']}, {meta['layers']}, {meta['tokens'] or 'preset'} tokens, "
             f"{meta['world_size']} ranks, {meta['dtype']}",
             "| strategy | fwd+bwd peak GiB / GPU | step peak GiB / GPU | step ms | vs none | offloaded MiB / step |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['strategy']} | {r['status']} | | | | |")
            continue
        lines.append(f"| {r['strategy']} | {num(r['activation_gib'], '.2f')} | {num(r['peak_gib'], '.2f')} | "
                     f"{num(r['step_ms'], '.1f')} | {num(r['vs_none'], '.2f')} | {r['offloaded_mib']:.0f} |")
    return "\n".join(lines)


def chart(payloads: list[dict[str, Any]], path: str) -> None:
    """bench's chart (memory vs step time), one panel per world size; FSDP2's own rows in grey."""
    from gradseam.tools.bench import chart as draw

    rows = []
    for p in payloads:
        for r in p["rows"]:
            own = r["strategy"].startswith("FSDP2")
            rows.append({"workload": f"{p['world_size']} x {p['device']}, fwd+bwd peak per GPU",
                         "strategy": f"ref: {r['strategy']}" if own else r["strategy"],
                         "peak_gib": r["activation_gib"], "step_ms": r["step_ms"], "status": r["status"]})
    first = payloads[0]
    draw(rows, path, f"FSDP2 + gradseam: {first['family']} {first['preset']}, {first['layers']}")
    print(f"wrote {path}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("job", choices=["check", "bench", "chart"])
    parser.add_argument("results", nargs="*", help="chart: bench JSON files, one panel each")
    parser.add_argument("--png", default="fsdp2.png", help="chart: where to write the PNG")
    parser.add_argument("--family", default="flux")
    parser.add_argument("--preset", default=None)
    parser.add_argument("--layers", type=int, default=None, help="keep the first K blocks of every block list")
    parser.add_argument("--tokens", type=int, default=None, help="image/video tokens (default: the preset's)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per row (bench)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--cpu", action="store_true", help="gloo on the CPU instead of NCCL on GPUs")
    parser.add_argument("--tiny", action="store_true", help="a tiny Flux instead of the preset (CPU tests)")
    parser.add_argument("--leave-out", action="append", default=[], metavar="LABEL",
                        help="check: a row not to run (repeatable; the first row, FSDP2 alone, is every row's control)")
    args = parser.parse_args()
    if args.job == "check":
        rows_to_check(args.leave_out)  # a wrong label stops here, before any process group starts
    if args.job == "chart":
        payloads = []
        for path in args.results:
            with open(path) as f:
                payloads.append(json.load(f))
        chart(payloads, args.png)
        return 0
    return check(args) if args.job == "check" else bench(args)


if __name__ == "__main__":
    # a rank that dies in native code (a segfault in the collective library) prints every thread's Python stack, so
    # the launcher's "exitcode -11" comes with where it happened
    faulthandler.enable()
    raise SystemExit(main())
