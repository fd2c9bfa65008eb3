"""The kit's built-model cache (gradseam.testing.builds): a copy is exactly what build() would give now, or the
model is built."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from cases import flux_inputs, flux_model, flux_reading

from gradseam.testing import Case, builds, references, run_step
from gradseam.testing.digests import model_digest


@pytest.fixture(autouse=True)
def no_templates() -> Iterator[None]:
    builds.forget()
    references.forget()
    yield
    builds.forget()


def _built_and_copied(case: Case) -> tuple[int, int]:
    info = builds.info()
    return info["built"], info["copied"]


def test_after_two_builds_that_agree_a_copy_is_the_model_and_leaves_the_generator_where_build_did() -> None:
    case = Case("flux-builds", lambda: flux_model(), flux_inputs, seed=3)
    torch.manual_seed(3)
    expected = case.build()
    after_build = torch.rand(4)  # what a check would draw next
    start = _built_and_copied(case)
    first, second = case.fresh(), case.fresh()
    copy = case.fresh()
    assert _built_and_copied(case) == (start[0] + 2, start[1] + 1)
    assert torch.equal(torch.rand(4), after_build)
    assert model_digest(copy) == model_digest(first) == model_digest(second) == model_digest(expected)
    # its own tensors: a check that trains or edits the copy leaves the next one as built
    with torch.no_grad():
        next(copy.parameters()).add_(1.0)
    assert model_digest(case.fresh()) == model_digest(expected)
    ref, got = run_step(expected, case), run_step(case.fresh(), case)
    assert all(torch.equal(a, b) for a, b in zip(ref.outputs, got.outputs))


def test_a_build_reading_data_a_test_changed_is_built_again() -> None:
    width = {"layers": 1}
    build = flux_reading(width)
    case = Case("flux-width", build, flux_inputs)
    for _ in range(3):
        one = case.fresh()
    width["layers"] = 2
    two = case.fresh()
    assert len(two.single_transformer_blocks) == 2 and len(one.single_transformer_blocks) == 1


def test_a_build_that_differs_each_time_is_never_copied() -> None:
    calls = iter(range(100))

    def build() -> torch.nn.Module:
        model = flux_model()
        if next(calls) == 1:  # only the second build differs: the one that decides
            torch.nn.init.zeros_(model.proj_out.weight)
        return model

    case = Case("flux-drifting", build, flux_inputs)
    start = _built_and_copied(case)
    for _ in range(4):
        case.fresh()
    assert _built_and_copied(case) == (start[0] + 4, start[1])


@pytest.mark.parametrize("extra", ["hook", "subclass"])
def test_a_model_with_hooks_or_tensor_subclasses_is_built_every_time(extra: str) -> None:
    class Marked(torch.Tensor):
        pass

    def build() -> torch.nn.Module:
        model = flux_model()
        if extra == "hook":
            model.proj_out.register_forward_hook(lambda m, a, o: None)
        else:
            model.register_buffer("marked", torch.zeros(2).as_subclass(Marked))
        return model

    case = Case(f"flux-{extra}", build, flux_inputs)
    start = _built_and_copied(case)
    for _ in range(3):
        case.fresh()
    assert _built_and_copied(case) == (start[0] + 3, start[1])


def test_the_cache_is_bounded() -> None:
    for seed in range(builds.MAX_BUILT + 3):
        case = Case("flux-seed", flux_model, flux_inputs, seed=seed)
        case.fresh()
        case.fresh()
    assert builds.info()["templates"] == builds.MAX_BUILT
