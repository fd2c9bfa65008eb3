"""gradseam inside the usual training wrappers, on the CPU: accelerate, torch's activation
checkpointing (what FSDP's and accelerate's ``activation_checkpointing`` apply) and FSDP2.

* accelerate: ``Accelerator().prepare`` + ``accelerator.backward`` on a patched model trains exactly
  as the same loop on the unpatched model.
* ``CheckpointWrapper``: blocks already wrapped by ``apply_activation_checkpointing`` are left to
  it (one GradseamWarning); gradseam does not checkpoint them a second time, still resolves the
  block classes through the wrapper, and still installs attention offload on them.
* FSDP2 (``fully_shard`` per block, 2 processes over gloo, through docs/scripts/fsdp2.py's check): every
  backend's full gradients equal the unpatched FSDP2 run's to the bit and the unsharded run's to 1e-5,
  every region gradseam planned ran inside the sharded blocks, and the model kept its handle.
"""

from __future__ import annotations

import copy
import os
import re
import socket
import sys

import pytest
import torch
from cases import FLUX
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointWrapper,
    apply_activation_checkpointing,
)

import gradseam
from gradseam.errors import GradseamWarning
from gradseam.offload import cpu_test_mode
from gradseam.testing import assert_same_step, run_step

TORCH = {"gradient_checkpointing": True, "gradient_checkpointing_backend": "torch"}
FFN = {"gradient_checkpointing": True, "gradient_checkpointing_backend": "torch-ffn"}


def _flux() -> torch.nn.Module:
    torch.manual_seed(FLUX.seed)
    return FLUX.build()


# -- accelerate -------------------------------------------------------------------------------


def _accelerate_loop(model: torch.nn.Module) -> tuple[list[float], dict[str, torch.Tensor]]:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = accelerator.prepare(model, opt)
    losses = []
    for step in range(2):
        inputs = FLUX.inputs(torch.Generator().manual_seed(step))
        loss = model(**inputs)[0].square().mean()
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in accelerator.unwrap_model(model).named_parameters()}


@pytest.mark.parametrize("config", [TORCH, FFN], ids=["torch", "torch-ffn"])
def test_accelerate_training_matches_unpatched(config):
    base = _flux()
    ref_losses, ref_params = _accelerate_loop(copy.deepcopy(base))
    model = copy.deepcopy(base)
    handle = gradseam.patch(model, config)
    losses, params = _accelerate_loop(model)
    assert gradseam.handle_of(model) is handle  # prepare() kept the patch
    assert losses == ref_losses
    assert params.keys() == ref_params.keys()
    assert all(torch.equal(params[n], ref_params[n]) for n in params), "parameters differ after two steps"


# -- torch's activation checkpointing (CheckpointWrapper) -------------------------------------


def _is_block(module: torch.nn.Module) -> bool:
    from diffusers.models.transformers.transformer_flux import (
        FluxSingleTransformerBlock,
        FluxTransformerBlock,
    )

    return isinstance(module, (FluxTransformerBlock, FluxSingleTransformerBlock))


def _warnings(record) -> list[str]:
    return [str(w.message) for w in record if issubclass(w.category, GradseamWarning)]


@pytest.mark.parametrize("config", [TORCH, FFN], ids=["torch", "torch-ffn"])
def test_checkpoint_wrapper_blocks_are_not_checkpointed_twice(config):
    base = _flux()
    wrapped = copy.deepcopy(base)
    apply_activation_checkpointing(wrapped, check_fn=_is_block)
    assert isinstance(wrapped.transformer_blocks[0], CheckpointWrapper)
    reference = run_step(wrapped, FLUX)
    model = copy.deepcopy(wrapped)
    with pytest.warns(GradseamWarning) as record:
        handle = gradseam.patch(model, config)
    messages = _warnings(record)
    assert len(messages) == 1 and "CheckpointWrapper" in messages[0], messages
    assert "7 block(s)" in messages[0]
    assert not handle.plan.regions  # nothing of gradseam's own: no nested checkpoint
    assert_same_step(reference, run_step(model, FLUX))
    handle.remove()
    assert_same_step(reference, run_step(model, FLUX))


def test_checkpoint_wrapper_on_some_blocks_only():
    base = _flux()
    from diffusers.models.transformers.transformer_flux import FluxSingleTransformerBlock

    model = copy.deepcopy(base)
    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, FluxSingleTransformerBlock))
    reference = run_step(copy.deepcopy(model), FLUX)
    with pytest.warns(GradseamWarning) as record:
        handle = gradseam.patch(model, TORCH)
    assert len(_warnings(record)) == 1
    assert {r.list_path for r in handle.plan.regions} == {"transformer_blocks"}  # the unwrapped ones
    assert len(handle.plan.regions) == 2
    assert_same_step(reference, run_step(model, FLUX))
    handle.remove()


def test_checkpoint_wrapper_keeps_attention_offload():
    model = _flux()
    apply_activation_checkpointing(model, check_fn=_is_block)
    reference = run_step(copy.deepcopy(model), FLUX)
    config = {**TORCH, "gradient_checkpointing_offload_attention": True}
    with cpu_test_mode():
        with pytest.warns(GradseamWarning):
            handle = gradseam.patch(model, config)
        kinds = {r.kind.name for r in handle.plan.regions}
        assert kinds == {"attention-offload"}
        assert len(handle.plan.regions) == 7  # one attention seam per block
        assert_same_step(reference, run_step(model, FLUX))
    assert handle.engine.copies > 0  # the offload hooks ran inside torch's checkpoint regions
    handle.remove()


def test_no_warning_without_wrappers():
    with pytest.warns() as record:
        gradseam.patch(_flux(), TORCH).remove()
        import warnings

        warnings.warn("sentinel", UserWarning, stacklevel=1)  # pytest.warns needs at least one
    assert not _warnings(record)


# -- FSDP2: the script (docs/scripts/fsdp2.py), 2 processes over gloo ------------------------------

WORLD = 2  # the ranks of the multi-process tests (tests/test_context_parallel.py too)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SCRIPT = os.path.join(os.path.dirname(__file__), "..", "docs", "scripts", "fsdp2.py")


# The quick suite leaves the ``compile`` row out (``-m compiled`` runs all 14): its blocks run the compiled function
# ``unsloth-compile``'s blocks run (gradseam.run.compiled), which only adds the offload group around the call, so the
# row left in has the compiled blocks under FSDP2's hooks; its compiling costs about 7 s on a 2-core runner.
@pytest.mark.parametrize("left_out", [pytest.param([], marks=pytest.mark.compiled, id="every-row"),
                                      pytest.param(["compile"], id="compile-left-out")])
def test_fsdp2_script_check_passes_for_every_strategy_on_cpu(tmp_path, left_out):
    """The script the H200 pair runs, here on a tiny Flux: each rank its own batch, every row's
    gradients (the compiled backends' included) vs the mean of both batches on one unsharded model."""
    import json
    import sys

    from ranks import run_ranks

    out = tmp_path / "check.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    leave_out = [arg for label in left_out for arg in ("--leave-out", label)]
    result = run_ranks(
        lambda: [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", f"--master-port={_free_port()}",
         SCRIPT, "check", "--cpu", "--tiny", "--json", str(out), *leave_out], env=env, timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())
    rows = {r["strategy"]: r for r in report["rows"]}
    expected = 14 - len(left_out)
    assert len(rows) == expected and all(r["ok"] for r in rows.values()) and not set(left_out) & set(rows), rows
    assert report["world_size"] == 2
    # On the CPU every gradseam row is bitwise the unpatched FSDP2 run...
    assert all(r["max_grad_rel_l2_vs_fsdp2_unpatched"] == 0.0 for r in rows.values())
    # ...the offload rows really moved activations, and interval chunks said why they fell back.
    assert rows["unsloth"]["offloaded_bytes"] > 0 and rows["attention offload"]["offloaded_bytes"] > 0
    # kernel outputs kept in host memory add to what the region inputs alone move
    assert rows["unsloth + attention offload"]["offloaded_bytes"] > rows["unsloth"]["offloaded_bytes"]
    assert any("forward pre-hooks" in w for w in rows["torch, interval 2"]["warnings"])
    # compiled blocks under FSDP2 (aot_eager on the CPU), what they keep offloaded through the engine
    assert rows["unsloth-compile"]["offloaded_bytes"] > 0
    assert "compile" in left_out or rows["compile"]["offloaded_bytes"] == 0
    # ...and gradseam's own regions ran inside the sharded blocks, every one it planned (the compiled blocks
    # too), and the model kept its handle through fully_shard; only the two rows without gradseam have none
    unpatched = {label for label, r in rows.items() if r["handle_kept"] is None}
    assert unpatched == {"FSDP2, no checkpointing", "FSDP2 + its own AC (checkpoint per block)"}, unpatched
    for label, row in rows.items():
        if label not in unpatched:
            ran, planned = row["regions_ran"]
            assert row["handle_kept"] is True and ran == planned, (label, row)
            assert planned > 0 or label == "attention offload", (label, row)  # its attention seams count no calls
    assert f"{expected}/{expected} strategies match" in result.stdout


def test_fsdp2_script_check_refuses_to_leave_out_an_unknown_row_or_the_control(monkeypatch):
    """``--leave-out`` names a row the check has, never the first (FSDP2 alone, every row's control): refused before
    any process group starts (``main`` asks first), naming the label and the rows."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("fsdp2_script", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, script)  # its dataclasses look their module up there
    spec.loader.exec_module(script)
    for label, said in (("torch-fnn", "--leave-out: no row is labelled 'torch-fnn'; the rows: FSDP2, no checkpointing"),
                        ("FSDP2, no checkpointing", "is every row's control; it always runs")):
        with pytest.raises(SystemExit, match=re.escape(said)):
            script.rows_to_check([label])
    assert [label for label, _ in script.rows_to_check(["compile"])] == [
        label for label, _ in script.ROWS if label != "compile"]


def test_only_a_rank_killed_by_a_native_crash_runs_again(monkeypatch):
    """tests/ranks.py: the launcher's report of a rank killed by SIGSEGV (as CI printed it) runs the command once
    more, with a fresh command (port) and a warning; a rank that failed in Python is the result as it is."""
    import subprocess

    import ranks

    crashed = ("  Root Cause (first observed failure):\n  [0]:\n    rank      : 0 (local_rank: 0)\n"
               "    exitcode  : -11 (pid: 20816)  (SIGSEGV)\n    traceback : Signal 11 (SIGSEGV) received by PID 20816\n")
    python_failure = "  [0]:\n    exitcode  : 1 (pid: 20816)\n    traceback : AssertionError: 13/14 strategies match\n"
    for first, runs in ((crashed, 2), (python_failure, 1)):
        calls: list[list[str]] = []

        def fake_run(cmd, first=first, calls=calls, **kwargs):
            calls.append(cmd)
            return subprocess.CompletedProcess(cmd, 1 if len(calls) == 1 else 0, "", first if len(calls) == 1 else "")

        monkeypatch.setattr(ranks.subprocess, "run", fake_run)
        ports = iter(range(2))

        def command(ports=ports) -> list[str]:
            return ["torchrun", f"--master-port={next(ports)}"]

        if runs == 2:
            with pytest.warns(UserWarning, match=r"died in native code \(exit 1\); running it once more"):
                done = ranks.run_ranks(command)
        else:
            done = ranks.run_ranks(command)
        assert len(calls) == runs and done.returncode == (0 if runs == 2 else 1)
        assert [c[-1] for c in calls] == [f"--master-port={i}" for i in range(runs)]


# -- interval chunks and blocks with forward pre-hooks -------------------------------------------


def test_interval_chunk_falls_back_per_block_when_a_later_block_has_a_pre_hook(checkpoint_calls):
    """A chunk computes its later blocks ahead of their own calls, which would skip their forward
    pre-hooks (FSDP2 gathers weights in one); such chunks checkpoint block by block instead."""
    model = _flux()
    seen: list[torch.nn.Module] = []
    hooks = [
        block.register_forward_pre_hook(lambda m, args, kwargs: seen.append(m), with_kwargs=True)
        for block in model.single_transformer_blocks
    ]
    reference = run_step(model, FLUX)
    calls_unpatched = list(seen)
    seen.clear()
    handle = gradseam.patch(model, {**TORCH, "gradient_checkpointing_interval": 2})
    with pytest.warns(GradseamWarning, match="chunk of FluxSingleTransformerBlock blocks fell back .* forward pre-hooks"):
        got = run_step(model, FLUX)
    assert_same_step(reference, got)
    assert seen == calls_unpatched  # every pre-hook ran once per block call, in order
    # 2 double blocks (no hooks) stay one chunk; 5 hooked single blocks: one region each (not 3 chunks)
    assert len(checkpoint_calls) == 1 + 5
    for hook in hooks:  # without the hooks the chunks come back: the fallback is not latched
        hook.remove()
    checkpoint_calls.clear()
    assert_same_step(reference, run_step(model, FLUX))
    assert len(checkpoint_calls) == 1 + 3
    handle.remove()
