from __future__ import annotations

import gc
import os
import sys
import warnings
from pathlib import Path

# No test reaches the network, whatever the machine allows: at import, bitsandbytes asks the Hugging Face hub
# for a CPU kernel (kernels-community/quantization-bitsandbytes) in every process that imports diffusers'
# models with peft installed, each xdist worker and each launched subprocess (they inherit this).
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))

# The CPU tests run tiny models: one thread avoids oversubscribing CI's two cores (10-40x faster).
torch.set_num_threads(1)

# Python's cyclic garbage collector, at its default thresholds (700, 10, 10), ran ~11,800 times in
# tests/test_conformance.py alone and took 13-14 s of its 64-77 s (one process, 2026-12-06): each full collection
# walks every object torch, diffusers and the collected tests hold. Collecting less often (a young generation of
# 10,000), and freezing what collection built once it ends (pytest_collection_finish), cut that to 2.4-2.8 s. The
# whole suite with -n 2 on the project's 2-core machine: 755.8 s before, 601.0 s after (1,430.9 and 1,130.7 s of
# test time summed over both workers; one run each, the same day).
# Tests that need garbage gone call gc.collect() themselves, as they must under any threshold. On a machine with
# CUDA (the `pytest -m cuda` runs) the collector keeps its defaults: that suite last passed with them, and cyclic
# garbage holding GPU memory is left to the collector's usual pace there.
QUICK_GC = not torch.cuda.is_available()
if QUICK_GC:
    gc.set_threshold(10_000, 10, 10)


# -- the quick subset: `python -m pytest -n 2 -m "not slow"` -------------------------------------------
#
# What is marked `slow` (pyproject.toml registers the mark), from one full run with --durations=0 on
# the project's 2-core CI machine: whole files that compile, spawn processes or draw hypothesis
# examples; single tests that run a subprocess, a benchmark sweep or a full-size preset, and every test
# that uses a fixture doing one of those (the fixture is paid by whichever test runs first); and in the
# files that run a model per case of a matrix (families x strategies), every case but each test's
# first, so every behaviour keeps one case in the quick subset. Rules by file, test and fixture name,
# so the test files themselves carry no marks. README.md and docs/getting-started.md give the measured times.

SLOW_FILES = {
    "test_compiled_backend.py", "test_compile.py",  # compiling blocks: 3-35 s a test on the CPU
    "test_fsdp.py", "test_context_parallel.py", "test_threads.py",  # process groups, threads
    "test_example_plugin.py",  # installs the example plugin into a fresh venv
    "test_config_fuzz.py",  # hypothesis: hundreds of examples
    "test_compiled_hostile.py",  # the compiled backends under real training loops: compiles per case
    "test_compiled_sharing.py",  # measuring's shared compiled functions: compiles
}
SLOW_TESTS = {  # by function name, in any file (every parametrization)
    # subprocesses: `python -m gradseam run`, torchrun, accelerate, mkdocs, the docs' scripts
    "test_trainer_under_gradseam_run_trains_as_the_plain_run",
    "test_every_torchrun_rank_is_patched", "test_accelerate_launch_runs_gradseam_as_the_program",
    "test_a_program_that_closes_its_streams_keeps_its_exit_code",
    "test_mkdocs_build_strict", "test_page_examples_run", "test_upstream_tests_script_patches_every_model_a_test_builds",
    "test_families_chart_draws_every_family_the_benchmarks_page_lists",
    "test_a_checkpoint_thread_and_an_atexit_save_pickle_the_scripts_classes",
    "test_bad_arguments_are_refused_before_torch_or_diffusers_is_imported",
    "test_cli_warnings_name_no_internal_line",
    # benchmark sweeps, the demo, real-size workloads and depth fits
    "test_demo_runs_the_size_its_title_says", "test_bench_threads_are_set_for_the_sweep_and_restored",
    "test_bench_creates_the_output_directory_before_running", "test_bench_synthetic_on_cpu_writes_json_and_png",
    "test_bench_oom_cell_is_reported_and_the_sweep_continues", "test_a_row_that_breaks_the_device_is_named_and_the_json_kept",
    "test_an_interrupted_bench_keeps_the_rows_it_measured", "test_chart_draws_a_wide_memory_span_on_a_log_axis",
    "test_cpu_sweep_measures_torch_rows_and_marks_offload_rows", "test_oom_in_one_cell_is_a_row_and_the_sweep_continues",
    "test_other_errors_in_a_cell_are_recorded", "test_payload_and_cpu_table_and_chart",
    "test_a_pinned_host_allocation_failure_is_an_oom_row_not_an_error",
    "test_a_row_that_breaks_the_device_ends_the_sweep_with_the_row_to_skip",
    "test_real_measures_two_depths_and_the_full_one_with_every_list_in_proportion",
    "test_real_with_the_full_model_built_picks_default_fit_depths",
    "test_applied_patches_compiles_and_restores_as_its_config_says",
    "test_advise_on_a_cpu_model_predicts_what_the_full_depth_keeps", "test_advise_predicts_from_the_highest_pass",
    "test_presets_plan_at_full_size", "test_preset_inputs_run_through_the_full_width_model_on_meta",
    "test_bench_workload_truncates_steps_and_patches_exactly", "test_workload_builds_truncates_and_steps",
    "test_compiled_blocks_match_compiled_unpatched",  # test_stack.py: compiles
    "test_patching_a_model_loads_no_tool",  # a subprocess
    "test_real_row_processes_that_stop_say_why_in_their_rows",  # bench --isolate-rows: a process per row
    "test_the_saved_bytes_count_leaves_quantized_weights_out",  # compiles
    "test_compiled_blocks_leave_hidreams_eval_routed_gates_without_a_gradient_as_eager",  # compiles
    "test_bench_family_sweep_writes_full_depth_rows",  # a bench --family sweep, end to end
    # copies and saves of whole patched models (one compiles), streaming's hostile uses beyond one step
    "test_deep_copies_and_pickles_of_the_other_backends_train_on_their_own",
    "test_a_streamed_model_deep_copied_or_pickled_streams_its_own_weights",
    "test_accumulation_retained_graphs_and_sampling_between_steps_stream_exactly",
    "test_re_patching_a_streamed_model_hands_its_host_copies_to_the_new_patch",
    # auto measuring every candidate at two depths (the quick subset keeps its cached and refused paths), bench's
    # auto row end to end, and a gloo process group for DDP
    "test_a_run_stopped_while_measuring_resumes_from_the_candidates_it_measured",
    "test_a_model_larger_than_its_gpu_budget_streams_from_patch_time_and_auto_plans_which_blocks_stay_resident",
    "test_the_auto_row_plans_at_its_first_step_within_bench_budgets_and_reports_the_plan",
    "test_distributed_data_parallel_is_unwrapped",
}
SLOW_FIXTURES = {  # (file, fixture): tests using the fixture are slow
    ("test_bench.py", "results"),  # a CPU bench sweep, once per module
    ("test_depth.py", "flux_run"),  # a depth fit: three depths of every row
    ("test_kit_for_plugin_authors.py", "plugin_repo"),  # each test runs pytest on it in a subprocess
}
# files whose parametrized tests run a model per case: the quick subset keeps each test's first case
MATRIX_FILES = {
    "test_conformance.py", "test_lifecycle.py", "test_faults.py", "test_peft.py", "test_numerics.py",
    "test_offload.py", "test_stack.py", "test_hostile.py", "test_loading.py", "test_image_families.py",
    "test_video_families.py", "test_exactness.py", "test_patch_api.py", "test_quantized.py", "test_weight_streaming.py",
}


def _is_matrix_file(name: str) -> bool:
    return name in MATRIX_FILES or name.startswith("test_family_")


def mark_slow(items) -> None:
    """Add the `slow` mark by the rules above (see the comment there)."""
    slow = pytest.mark.slow
    seen: set[tuple[str, str, str]] = set()
    for item in items:
        name = item.path.name
        function = getattr(item, "originalname", item.name)
        # the kit's compiled rows are left out by default (pyproject's addopts: -m 'not compiled'), which
        # a `-m "not slow"` on the command line replaces: they are slow too
        fixtures = getattr(item, "fixturenames", ())
        if (name in SLOW_FILES or function in SLOW_TESTS or "compiled" in item.keywords
                or any((name, f) in SLOW_FIXTURES for f in fixtures)):
            item.add_marker(slow)
            continue
        if _is_matrix_file(name) and getattr(item, "callspec", None) is not None:
            key = (name, item.cls.__name__ if item.cls is not None else "", function)
            if key in seen:
                item.add_marker(slow)
            seen.add(key)


def pytest_collection_finish(session):
    """Freeze what importing and collecting built (modules, classes, parametrized cases): the collector never
    walks it again (the comment at gc.set_threshold above)."""
    if QUICK_GC:
        gc.collect()
        gc.freeze()


def pytest_collection_modifyitems(config, items):
    mark_slow(items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run with -m cuda on a GPU machine)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fresh_warnings():
    # gradseam warns once per message per process; tests that check warnings need a clean slate.
    from gradseam import errors

    errors.warned.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        yield


@pytest.fixture(autouse=True)
def _process_state_back():
    # `gradseam run` leaves the program's __main__, sys.argv and sys.path in place for the rest of the
    # process, as python does (tests/test_launch.py runs programs in-process): put them back per test.
    main, argv, path = sys.modules.get("__main__"), sys.argv[:], sys.path[:]
    yield
    if main is not None and sys.modules.get("__main__") is not main:
        sys.modules["__main__"] = main
    sys.argv = argv
    if sys.path != path:
        sys.path[:] = path


@pytest.fixture
def checkpoint_calls(monkeypatch):
    """Counts the checkpoint regions gradseam opens (each call of torch.utils.checkpoint by gradseam)."""
    from gradseam.run import chains as strategies

    calls: list[int] = []
    real = strategies.checkpoint

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(strategies, "checkpoint", counting)
    return calls


@pytest.fixture
def even_spread(monkeypatch):
    """Streamed blocks placed evenly by position, as they were until the twenty-third session placed them by size
    (:func:`gradseam.planning.spread`): the cost tables an H100 measured for Flux's streamed counts hold the blocks
    that rule chose, and a replay of them must ask for the same blocks."""
    from gradseam import planning

    def even(count: int, sizes) -> list[int]:
        total = len(sizes)
        count = min(max(count, 0), total)
        return [((2 * k + 1) * total) // (2 * count) for k in range(count)]

    monkeypatch.setattr(planning, "spread", even)


def _entry_points() -> dict[str, str]:
    from pathlib import Path

    import tomllib

    data = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())
    return dict(data["project"]["entry-points"]["gradseam"])


def builtin_plugins() -> list[str]:
    """The built-in plugins' entry-point names, as pyproject.toml declares them (sorted)."""
    return sorted(_entry_points())


def builtin_families() -> list[str]:
    """The names of the families the built-in plugins declare, read from their modules (sorted): a plugin
    may declare several (joyimage), or none (left-out, which only names unsupported classes)."""
    import importlib

    names: list[str] = []
    for module in _entry_points().values():
        hook = getattr(importlib.import_module(module), "register_families", None)
        if hook is not None:
            hook(register=lambda family: names.append(family.name))
    return sorted(names)


def builtin_family_plugins() -> list[str]:
    """The built-in plugins that declare at least one family (sorted)."""
    import importlib

    found = []
    for name, module in _entry_points().items():
        hook = getattr(importlib.import_module(module), "register_families", None)
        declared: list[object] = []
        if hook is not None:
            hook(register=declared.append)
        if declared:
            found.append(name)
    return sorted(found)
