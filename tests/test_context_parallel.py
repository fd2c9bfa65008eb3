"""diffusers' context parallelism (Ulysses) with every gradseam backend, 2 CPU processes over gloo.

diffusers 0.42.1 splits the sequence across ranks at the first block and gathers it after the last
(the model's ``_cp_plan``); inside each attention call an all-to-all trades sequence shards for
head shards. gradseam's regions sit around whole blocks, their FFN or their attention kernels, so a
region's recompute in backward runs the same collectives again, in the same order on every rank.
What is checked: on each rank, outputs, the input's and every parameter's gradient of a CP run with
gradseam equal the same CP run without it, bit for bit (the compiled backends to the compiler's
rounding), with gradseam applied after ``enable_parallelism``. The other order (patch, then enable
CP, as ``gradseam run`` followed by a trainer that enables CP would do) puts CP's split hook outside
gradseam's seam, where a recompute would split a block's inputs twice: it is refused at the first
forward with the fix, and the fix (remove, patch again) is exact.

Two things the CPU needs: diffusers picks the rank's device as ``rank % torch.accelerator.device_count()``,
which is a division by zero on a CPU-only build, so the workers report one device (the CPU that gloo
runs on); and only Ulysses runs here, since ring attention needs a kernel that returns its softmax
statistics (``return_lse``), which diffusers' native backend refuses ("Native attention does not
support return_lse=True"): on GPUs the flash backends have it (docs/trainer.md).
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from cases import WAN
from test_fsdp import WORLD, _free_port

import gradseam
from gradseam.offload import cpu_test_mode
from gradseam.testing import COMPILED_TOLERANCE, Case, assert_same_step, run_step
from gradseam.tools.named_strategies import rows

ROWS = rows("torch", "torch-ffn", "unsloth", "unsloth-ffn", "attention offload", "torch, interval 2",
            "torch + attention kept", "unsloth + attention offload", "unsloth-compile")
# ``compile`` runs under `-m compiled` only (pyproject.toml deselects the mark by default), to keep the suite within
# CI's time: its blocks run the compiled function ``unsloth-compile``'s blocks run (gradseam.run.compiled), which
# only adds the offload group around the call, so the row above has the compiled graph under Ulysses' all-to-all;
# two more processes and their compiling cost about 10 s on a 2-core runner.
COMPILED_ONLY_ROWS = rows("compile")
COMPILED = {"compile", "unsloth-compile"}
# diffusers' gather hook takes tensors only: the model must return a tuple
CASE = Case("wan-cp", WAN.build, lambda g: {**WAN.inputs(g), "return_dict": False}, lambda out: out[0], WAN.seed)


def _enable(model: torch.nn.Module) -> None:
    from diffusers.models._modeling_parallel import ContextParallelConfig

    model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=WORLD))


def _model(parallel: bool = True) -> torch.nn.Module:
    torch.manual_seed(CASE.seed)
    model = CASE.build()
    if parallel:
        _enable(model)
    return model


def _worker(rank: int, port: int, out_dir: str, labels: list[str], refusal: bool) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch.accelerator.device_count = lambda: 1  # the CPU gloo runs on (see the module docstring)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        found: dict[str, object] = {"reference": run_step(_model(), CASE)}
        with cpu_test_mode():
            for label, config in [row for row in ROWS + COMPILED_ONLY_ROWS if row[0] in labels]:
                model = _model()
                handle = gradseam.patch(model, config)
                found[label] = run_step(model, CASE)
                found[f"{label} ran"] = all(r.ran for r in handle.regions())
                handle.remove()
                found[f"{label} after remove"] = run_step(model, CASE)
            if refusal:
                _patched_first(found)
        found["unsplit"] = run_step(_model(parallel=False), CASE)
        torch.save(found, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _patched_first(found: dict[str, object]) -> None:
    """gradseam first, then context parallelism: refused at the first forward, with the fix..."""
    model = _model(parallel=False)
    handle = gradseam.patch(model, {"gradient_checkpointing": True})
    _enable(model)
    try:
        run_step(model, CASE)
    except gradseam.GradseamError as exc:
        found["patched first"] = str(exc)
    # ...which works: remove, enable (already on), patch again
    handle.remove()
    handle = gradseam.patch(model, {"gradient_checkpointing": True})
    found["re-patched"] = run_step(model, CASE)
    found["re-patched ran"] = all(r.ran for r in handle.regions())


def _spawn(labels: list[str], refusal: bool) -> list[dict]:
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_worker, args=(_free_port(), out_dir, labels, refusal), nprocs=WORLD, join=True)
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(WORLD)]


@pytest.fixture(scope="module")
def ranks():
    return _spawn([label for label, _ in ROWS], refusal=True)


@pytest.fixture(scope="module")
def compiled_only_ranks():
    return _spawn([label for label, _ in COMPILED_ONLY_ROWS], refusal=False)


def test_context_parallel_is_real(ranks):
    # the split changes the computation (each rank's input gradient covers its own shard), and the
    # gathered output is the unsplit model's
    for found in ranks:
        assert found["reference"].outputs[0].shape == found["unsplit"].outputs[0].shape
        torch.testing.assert_close(found["reference"].outputs[0], found["unsplit"].outputs[0])
    assert not torch.equal(ranks[0]["reference"].input_grads["hidden_states"],
                           ranks[1]["reference"].input_grads["hidden_states"])


def _matches_context_parallel_alone(ranks: list[dict], label: str) -> None:
    atol = COMPILED_TOLERANCE if label in COMPILED else 0.0
    for rank, found in enumerate(ranks):
        assert found[f"{label} ran"], f"rank {rank}: {label}: a region did not run"
        assert_same_step(found["reference"], found[label], atol=atol, what=f"rank {rank} {label}")
        assert_same_step(found["reference"], found[f"{label} after remove"], what=f"rank {rank} {label} removed")


@pytest.mark.parametrize("label", [label for label, _ in ROWS])
def test_every_backend_under_ulysses_matches_context_parallel_alone(ranks, label):
    _matches_context_parallel_alone(ranks, label)


@pytest.mark.compiled
@pytest.mark.parametrize("label", [label for label, _ in COMPILED_ONLY_ROWS])
def test_compiled_only_rows_under_ulysses_match_context_parallel_alone(compiled_only_ranks, label):
    _matches_context_parallel_alone(compiled_only_ranks, label)


def test_enabling_context_parallelism_after_patching_is_refused_and_repatching_is_exact(ranks):
    # its split hook would wrap gradseam's seam and split a recomputed block's inputs twice
    for rank, found in enumerate(ranks):
        message = found["patched first"]
        assert "context parallelism was enabled after gradseam patched the model" in message
        assert "'cp_input---" in message and "WanTransformerBlock" in message
        assert "Enable context parallelism first and patch afterwards" in message
        assert found["re-patched ran"]
        assert_same_step(found["reference"], found["re-patched"], what=f"rank {rank} re-patched")


# -- the refusal, one process: which hooks count as outside the seam ---------------------------------


def _named_hook(module: torch.nn.Module, name: str) -> None:
    from diffusers.hooks import HookRegistry, ModelHook

    HookRegistry.check_if_exists_or_initialize(module).register_hook(ModelHook(), name)


def test_only_a_context_parallel_hook_registered_after_the_seam_is_refused():
    from seam_probe import installed_seam

    from gradseam.run.seams import _argument_hook_outside

    reference = run_step(_model(parallel=False), CASE)
    # a split hook registered before gradseam sits inside the seam; a casting-like hook after it is harmless
    model = _model(parallel=False)
    _named_hook(model.blocks[0], "cp_input---blocks.0")
    handle = gradseam.patch(model, {"gradient_checkpointing": True})
    seam = installed_seam(model.blocks[0])
    _named_hook(model.blocks[0], "layerwise_casting")
    assert seam is not None and _argument_hook_outside(seam) is None
    assert_same_step(reference, run_step(model, CASE))
    handle.remove()
    # registered after gradseam, it wraps the seam: refused before anything runs twice
    model = _model(parallel=False)
    handle = gradseam.patch(model, {"gradient_checkpointing": True})
    seam = installed_seam(model.blocks[1])
    _named_hook(model.blocks[1], "cp_output---blocks.1")
    assert seam is not None and _argument_hook_outside(seam) == "cp_output---blocks.1"
    with pytest.raises(gradseam.GradseamError, match="'cp_output---blocks.1' on WanTransformerBlock wraps"):
        run_step(model, CASE)
    handle.remove()
