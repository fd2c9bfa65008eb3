"""A newcomer's first hour: warnings that point at their own line, and timings that say when they are noise.

The noise rules are checked on made-up timing lists, never on a timed run: on a shared 2-core
machine a timed test would itself be the noise it is meant to detect.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import gradseam
from gradseam.errors import GradseamWarning
from gradseam.tools import measure
from gradseam.tools.measure import NOISY_SPREAD, noise, noise_marks, noise_note, spread

# -- warnings name the caller's line --------------------------------------------------------------


def _tiny_flux():
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    model = FluxTransformer2DModel(
        patch_size=1, in_channels=4, num_layers=2, num_single_layers=2, attention_head_dim=8,
        num_attention_heads=2, joint_attention_dim=16, pooled_projection_dim=8, axes_dims_rope=[2, 2, 4],
    )
    batch = {"hidden_states": torch.randn(1, 16, 4), "encoder_hidden_states": torch.randn(1, 8, 16),
             "pooled_projections": torch.randn(1, 8), "timestep": torch.tensor([0.5]),
             "img_ids": torch.randn(16, 3), "txt_ids": torch.zeros(8, 3)}
    return model, batch


def _edit_in_place(module, args, output):
    output[1].mul_(1.0)  # a forward hook that edits the block's output in place: the chunk falls back


def test_warnings_point_at_the_callers_line():
    """Whether gradseam warns from patch(), from a patched method or from inside a forward (through
    torch's and diffusers' frames), the warning names this file, not a gradseam module."""
    model, batch = _tiny_flux()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        handle = gradseam.patch(model, gradient_checkpointing=True, gradient_checkpointing_interval=2)
        model.transformer_blocks[0].register_forward_hook(_edit_in_place)
        model(**batch).sample.sum().backward()  # warns from inside the forward
        model.enable_gradient_checkpointing()  # warns from the patched method
        handle.remove()
        gradseam.patch(model, gradient_checkpointing=True, gradient_checkpointing_backend="torch-ffn",
                       gradient_checkpointing_interval=2).remove()  # warns from patch()
    ours = [w for w in caught if issubclass(w.category, GradseamWarning)]
    messages = [str(w.message) for w in ours]
    assert any("fell back" in m for m in messages), messages
    assert any("enable_gradient_checkpointing() called" in m for m in messages), messages
    assert any("does not group FFN regions" in m for m in messages), messages
    assert {w.filename for w in ours} == {__file__}, [(w.filename, w.lineno) for w in ours]


def test_warn_once_counts_levels_past_gradseam_frames():
    """Called from a gradseam module's function (as the planner does), the warning still lands here."""
    from gradseam import errors

    errors.warned.discard("a test message")
    with pytest.warns(GradseamWarning, match="a test message") as record:
        errors.warn_once("a test message")
    assert record[0].filename == __file__


# -- the spread of the timed steps ------------------------------------------------------------------


def test_spread_is_range_over_median():
    assert spread([100.0, 110.0, 120.0]) == pytest.approx(0.2 / 1.1)
    assert spread([100.0]) is None  # one step says nothing about the scatter
    assert spread([]) is None
    assert measure.Measurement(0.0, 110.0, step_times_ms=(100.0, 110.0, 120.0)).spread == pytest.approx(0.2 / 1.1)


NONE = [250.0, 255.0, 260.0]  # no checkpointing, steady


@pytest.mark.parametrize(("times", "reference", "why"), [
    # the demo's report from a busy 2-core machine: 'torch' at 0.78x of no checkpointing
    ([195.0, 197.0, 199.0], NONE, "faster than none"),
    # the row's own steps disagree; so they overlap no checkpointing's, and their median is below it:
    # every reason is named
    ([140.0, 200.0, 450.0], NONE, "scattered, overlaps, faster than none"),
    ([330.0, 333.0, 336.0], [200.0, 255.0, 330.0], "reference scattered, overlaps"),  # the reference's disagree
    ([258.0, 262.0, 266.0], NONE, "overlaps"),  # a step as fast as one of no checkpointing's
    ([330.0, 333.0, 336.0], NONE, None),  # 1.3x, steady: a real cost
    ([330.0], [255.0], "single step"),  # one step each (--steps 1): no spread, so no ratio is measured
    ([200.0], [255.0], "single step, faster than none"),
    ([330.0, 333.0], [255.0], "single step"),  # the reference's single step
    ([], NONE, None),  # not measured
])
def test_noise_rules(times, reference, why):
    assert noise(times, reference) == why


def test_the_scatter_threshold_is_a_fraction_of_the_median():
    assert NOISY_SPREAD == 0.2
    assert noise([150.0, 151.0], [100.0, 122.0]) is None  # 22 / 111 = 0.198 of the median
    assert noise([150.0, 151.0], [100.0, 123.0]) == "reference scattered"  # 23 / 111.5 = 0.206


def test_noise_marks_judge_the_reference_only_on_its_scatter():
    assert noise_marks([NONE, NONE]) == [None, "overlaps"]  # the reference never overlaps itself
    assert noise_marks([[100.0, 300.0], [400.0, 401.0]]) == ["scattered", "reference scattered"]
    assert noise_marks([[255.0], [330.0]]) == [None, "single step"]  # the reference's 1.00 is 1 by definition
    assert noise_marks([]) == []


def test_noise_note_says_why_and_what_to_trust():
    assert noise_note([None, None]) is None
    note = noise_note([None, "faster than none", "overlaps"])
    assert note.startswith("* step time within noise (")
    assert "overlap those of no checkpointing" in note and "ran faster than no checkpointing" in note
    assert "trust the memory and gradient columns, which are exact" in note
    assert note.count(". ") == 0  # one sentence


def test_demo_rows_marked_from_their_timed_steps():
    from gradseam.tools.demo import DemoRow
    from gradseam.tools.demo import noise_marks as demo_marks

    rows = [DemoRow("none", 55.6, 255.0, 0.0, step_times_ms=tuple(NONE)),
            DemoRow("torch", 3.4, 197.0, 0.0, step_times_ms=(195.0, 197.0, 199.0)),
            DemoRow("torch-ffn", 43.1, 333.0, 0.0, step_times_ms=(330.0, 333.0, 336.0))]
    assert demo_marks(rows) == [None, "faster than none", None]
    assert rows[1].spread == pytest.approx(4 / 197)


# -- bench's CPU table ------------------------------------------------------------------------------


def _bench_rows():
    from gradseam.tools.bench_report import with_ratios
    from gradseam.tools.results import Result

    results = [
        Result("w", 256, "none", 0.05, 255.0),
        Result("w", 256, "torch", 0.004, 197.0),
        Result("w", 256, "torch-ffn", 0.04, 333.0),
        Result("w", 256, "unsloth", None, None, "needs CUDA"),
        Result("v", 64, "torch", 0.001, 50.0),  # no 'none' row at this workload: nothing to compare with
    ]
    steps = [NONE, [195.0, 197.0, 199.0], [330.0, 333.0, 336.0], None, [40.0, 90.0]]
    return with_ratios(results, steps)


def test_bench_rows_keep_their_timed_steps_and_get_marked():
    from gradseam.tools.bench_report import noise as bench_noise

    rows = _bench_rows()
    assert rows[0]["step_times_ms"] == NONE and rows[3]["step_times_ms"] is None
    assert bench_noise(rows) == [None, "faster than none", None, None, None]


def test_bench_cpu_table_marks_noise_and_says_so():
    from gradseam.tools.bench_report import cpu_noise_note, to_markdown

    rows = _bench_rows()
    table = to_markdown(rows, cpu=True)
    assert "| step ms (spread) |" in table.splitlines()[0]
    assert "| w | none | 51.20 |  | 255.0 (4%) | 1.00 | 1.294 |" in table
    assert "| torch | 4.10 |  | 197.0 (2%) | 0.77* |" in table
    assert "| torch-ffn | 40.96 |  | 333.0 (2%) | 1.31 |" in table
    note = cpu_noise_note(rows)
    assert note.startswith("* step time within noise (it ran faster than no checkpointing")
    assert "trust the memory column (bytes kept for backward)" in note
    gpu = to_markdown(rows)  # the GPU table is unchanged: compiled rows there may well beat eager 'none'
    assert "*" not in gpu and "(spread)" not in gpu
    assert cpu_noise_note([dict(r, step_times_ms=None) for r in rows]) is None


def test_an_offloading_backend_with_checkpointing_off_patches_nothing_and_does_not_crash():
    """`gradseam run --no-checkpointing --backend unsloth` used to fail inside the script's from_pretrained
    ("offloading region inputs needs an engine"): the plan now decides that nothing runs, and says so."""
    import sys
    import warnings

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    from cases import FLUX

    import gradseam

    model = FLUX.build()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        handle = gradseam.patch(model, {"gradient_checkpointing": False, "gradient_checkpointing_backend": "unsloth"})
    assert handle.plan.regions == () and handle.engine is None
    assert any("gradient_checkpointing_backend set but gradient_checkpointing is false" in str(w.message)
               for w in caught)
    handle.remove()
