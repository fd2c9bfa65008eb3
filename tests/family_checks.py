"""Checks and probes the per-family test files (``test_family_*.py``) share.

Every family file asks the same few questions of its tiny model: does each interval chunk run whole, what
does the loop hand each block, which lists do the plan's regions cover, does an input change the output,
are the FFN backends refused where the family declares no FFN seam. The code that asks them was written
again in each file; it lives here once, so a fix or a stricter probe reaches every family. Each helper
only gathers or checks what the tests used to inline: the tests keep their own expected values.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import Any

import pytest
import torch
from torch import nn

import gradseam
from gradseam.errors import UnsupportedStrategyError
from gradseam.patcher import family_for
from gradseam.planning import plan
from gradseam.registry import REGISTRY
from gradseam.testing import Case, ParityReport, check_strategy, run_step


def sample_output(case: Case, model: nn.Module | None = None, **changes: Any) -> torch.Tensor:
    """The ``.sample`` of one no-grad forward of ``case`` (a fresh model unless ``model`` is given) on its
    seed-1 inputs with ``changes`` swapped in: how the family files show that an input reaches the output."""
    model = model if model is not None else case.fresh()
    with torch.no_grad():
        return model(**{**case.inputs(torch.Generator().manual_seed(1)), **changes}).sample


def record_block_calls(blocks: Iterable[nn.Module]) -> tuple[list[dict[str, Any]], list[Any]]:
    """Hooks on ``blocks`` that record, per call, the arguments bound to the block's parameter names and
    what the block returned: what the carry tests compare (the loop must hand every block the same objects,
    and each block what the previous one returned). The lists fill as the model runs."""
    seen: list[dict[str, Any]] = []
    returned: list[Any] = []
    for block in blocks:
        sig = inspect.signature(block.forward)
        block.register_forward_pre_hook(
            lambda _m, a, kw, _s=sig: seen.append(_s.bind(*a, **kw).arguments), with_kwargs=True)
        block.register_forward_hook(lambda _m, _a, out: returned.append(out))
    return seen, returned


def check_chunks_run_whole(case: Case, config: dict[str, Any], expected: Sequence[str]) -> ParityReport:
    """``check_strategy(case, config, whole=True)`` plus the sorted labels of its chunk regions checked
    against ``expected``: a wrong carry is still exact (chunks fall back), so the labels are what tells.
    Returns the report for the file's own further checks."""
    report = check_strategy(case, config, whole=True)
    assert sorted(r.label for r in report.regions if r.shape == "chunk") == expected
    return report


def chunks_served_whole(case: Case, config: dict[str, Any]) -> dict[str, bool]:
    """Each chunk of one patched step of ``case`` under ``config``, as ``list[blocks]`` (the list's last
    name), and whether it ran without a fallback: for files that check chunks through the handle."""
    model = case.fresh()
    with gradseam.patch(model, config) as handle:
        run_step(model, case)
        return {f"{r.list_path.rsplit('.', 1)[-1]}{list(r.blocks)}": not r.fallbacks
                for r in handle.regions() if r.shape == "chunk"}


def assert_chunks_chain_without_fallback(case: Case, lists: Sequence[str]) -> None:
    """Interval 2 on ``case``: the plan has chunks in exactly ``lists``, and after one step every chunk was
    called once and never fell back (the multi-list image families' carry check)."""
    model = case.fresh()
    handle = gradseam.patch(model, gradient_checkpointing=True, gradient_checkpointing_interval=2)
    try:
        chunks = [r for r in handle.plan.regions if r.shape == "chunk"]
        assert {r.list_path for r in chunks} == set(lists)
        run_step(model, case)
        for region in handle.regions():
            if region.shape == "chunk":
                assert region.chunk_calls == 1 and not region.fallbacks, f"{region.label} fell back: {region.fallbacks}"
    finally:
        handle.remove()


def blocks_per_list(regions: Iterable[Any]) -> dict[str, int]:
    """How many distinct blocks of each list the planned ``regions`` cover: the full-size preset tests check
    a plan reaches every block of every list, whatever the regions' shapes."""
    covered: dict[str, set[int]] = {}
    for region in regions:
        covered.setdefault(region.list_path, set()).update(region.blocks)
    return {k: len(v) for k, v in covered.items()}


def assert_ffn_backends_refused(case: Case, family: str) -> None:
    """For a family that declares no FFN seam: both ``-ffn`` backends are refused with the message that says
    so, and the refused patch leaves the model untouched (no handle, no instance attribute added)."""
    assert not REGISTRY.get(family).has_ffn
    model = case.fresh()
    dicts = {name: set(m.__dict__) for name, m in model.named_modules()}
    for backend in ("torch-ffn", "unsloth-ffn"):
        with pytest.raises(UnsupportedStrategyError, match=f"backend {backend!r} needs an FFN boundary"):
            gradseam.patch(model, gradient_checkpointing=True, gradient_checkpointing_backend=backend)
    assert gradseam.handle_of(model) is None
    assert {name: set(m.__dict__) for name, m in model.named_modules()} == dicts


def declare_ffn_seam(monkeypatch: pytest.MonkeyPatch, family: str, chain: tuple[str, ...]) -> None:
    """Make the patcher see ``family`` with ``chain`` as every block class's one FFN seam, for this test
    only: how a file shows why the family declares no such seam (it would fall apart or save too much)."""
    import gradseam.patcher as patcher

    declared = REGISTRY.get(family)
    trial = replace(declared, block_classes=tuple(replace(bc, ffn=(chain,)) for bc in declared.block_classes))
    monkeypatch.setattr(patcher, "family_for", lambda _m: trial)


def assert_ffn_seam_is_one_module(case: Case, family: str, ffn_config: dict[str, Any], *, blocks: str = "blocks",
                                  ffn: str = "ffn", norm: str = "norm3", never_called: Sequence[str] = ()) -> None:
    """For the Wan-style blocks (``attn1``, ``attn2``, a norm, one feed-forward module): the plan has one
    region per block around ``ffn`` alone, and ``norm`` cannot join it because ``ffn`` is fed its output
    scaled and shifted. The submodules ``never_called`` must not run at all."""
    model = case.fresh()
    declared_family = family_for(model)
    assert (declared_family.name == family and declared_family.has_ffn and declared_family.has_attention
            and declared_family.supports_interval)
    first = getattr(model, blocks)[0]
    declared = declared_family.block_class_for(type(first))
    assert (declared.ffn, declared.attention) == (((ffn,),), ("attn1", "attn2"))
    the_plan = plan(model, declared_family, gradseam.CheckpointConfig.coerce(ffn_config))
    assert [(r.blocks, r.seam) for r in the_plan.regions] == [((i,), (ffn,)) for i in range(4)]
    fed: dict[str, torch.Tensor] = {}
    getattr(first, norm).register_forward_hook(lambda _m, _a, out: fed.__setitem__(norm, out))
    getattr(first, ffn).register_forward_hook(lambda _m, a, _o: fed.__setitem__(ffn, a[0]))
    for name in never_called:
        getattr(first, name).register_forward_hook(lambda _m, _a, out, _n=name: fed.__setitem__(_n, out))
    with torch.no_grad():
        model(**case.inputs(torch.Generator().manual_seed(1)))
    assert not [name for name in never_called if name in fed]
    assert fed[ffn] is not fed[norm] and not torch.equal(fed[ffn], fed[norm])


def prompt_mask(text: int, *valid: int) -> torch.Tensor:
    """A tokenizer's attention mask (int64) for prompts of ``valid`` tokens each, right-padded to ``text``
    tokens: the input the text-masked video families take."""
    mask = torch.zeros(len(valid), text, dtype=torch.int64)
    for row, n in enumerate(valid):
        mask[row, :n] = 1
    return mask


def record_first_calls(block: nn.Module, names: Iterable[str]) -> dict[str, tuple[tuple, Any]]:
    """Hooks on the submodules ``names`` of ``block`` that keep each one's first call as ``(args, output)``:
    how the files show which tensor a submodule is fed (and so why no seam can span it). Fills as it runs."""
    calls: dict[str, tuple[tuple, Any]] = {}

    def record(name: str) -> Any:
        def hook(_module: nn.Module, args: tuple, out: Any) -> None:
            calls.setdefault(name, (args, out))

        return hook

    for name in names:
        getattr(block, name).register_forward_hook(record(name))
    return calls


def assert_plans_cover_every_block(model: nn.Module, family: Any, blocks: int,
                                   counts: Iterable[tuple[dict[str, Any], int]]) -> None:
    """For each ``(config, regions)`` of ``counts``: the plan of the (full-size, meta) ``model`` under
    ``config`` has ``regions`` regions and they cover blocks ``0 .. blocks - 1``, as the preset tests
    check every strategy plans the whole stack."""
    for config, regions in counts:
        the_plan = plan(model, family, gradseam.CheckpointConfig.coerce(config))
        assert len(the_plan.regions) == regions
        assert {i for r in the_plan.regions for i in r.blocks} == set(range(blocks))
