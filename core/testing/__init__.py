"""The conformance kit: what any adapter (built-in or third-party) must pass.

A plugin describes its family's tiny test model as a :class:`Case` and either subclasses
:class:`ConformanceSuite` in its own pytest run (one test per configuration, so a failure names
the configuration) or calls the checks here directly. gradseam's own tests use exactly these
functions for every built-in family.

The checks compare against the *unpatched* model on the CPU in float32, where gradseam must be
exact: same outputs, same gradient for every parameter and every input, to the bit. Exactness
alone is not enough, though: a seam that the model never calls is trivially exact and saves
nothing, and an interval chunk that falls back to per-block regions is exact but not what the
user asked for. :func:`check_strategy` therefore also records, per planned region, how often it
ran and whether it ran as one region, and :func:`check_declared_sides` where attention kernels run
against what the family declares (no FFN seam around attention, no kernel outside the attention side), and
every call into a block, or read of one of its tensors, from outside its forward against
``BlockList.called_outside`` (weight streaming keeps those submodules and tensors resident).

The package is the kit's public surface (everything in ``__all__``); its modules hold one idea each:

* :mod:`~gradseam.testing.steps`: cases, one training step, and comparing two steps;
* :mod:`~gradseam.testing.regions`: how each region of a patched model ran, and what the kit demands of it;
* :mod:`~gradseam.testing.kernels`: where attention kernels run, against the family's declaration;
* :mod:`~gradseam.testing.outside`: calls into a block from outside its forward, against the declaration;
* :mod:`~gradseam.testing.references`: the unpatched reference step of a case, computed once and reused;
* :mod:`~gradseam.testing.checks`: the checks (``check_strategy``, ``check_no_grad``, ...);
* :mod:`~gradseam.testing.matrices`: the configuration matrices, full and reduced, and their test ids;
* :mod:`~gradseam.testing.facts`: the one place the kit reads the backend catalog and the strategy;
* :mod:`~gradseam.testing.quantized`: a case with its blocks quantized (LoRA on a quantized base), checked
  against its unpatched twin (``check_quantized``; optional: ``pip install 'gradseam[quant]'``);
* :mod:`~gradseam.testing.suite` and :mod:`~gradseam.testing.plugin`: the pytest suite a plugin
  subclasses, and the kit as a pytest plugin.

The package is also a pytest plugin (registered by the first :class:`ConformanceSuite` pytest collects,
or with ``-p gradseam.testing``): it declares the kit's ``compiled`` marker and leaves the compiled rows
out unless ``-m`` selects them. Its hooks are the ``pytest_*`` functions below, from
:mod:`~gradseam.testing.plugin`.
"""

from __future__ import annotations

from ..summary import RegionView
from ..tools.measure import count_saved_bytes
from .checks import (
    ParityReport,
    check_bench_workload,
    check_builtin_flag,
    check_declared_sides,
    check_no_grad,
    check_strategy,
    preset_model,
)
from .facts import COMPILED_TOLERANCE
from .kernels import (
    KernelMap,
    KernelSite,
    assert_attention_side_covers_kernels,
    assert_seams_hold_no_attention,
    count_kernels,
    locate_kernels,
)
from .matrices import config_id, cpu_configs, offload_configs, pick, reduced_configs, reduced_offload_configs
from .plugin import (
    COMPILED_MARK,
    MARKERS,
    pytest_collection_modifyitems,
    pytest_configure,
    pytest_terminal_summary,
)
from .quantized import QUANTIZED_BASES, check_quantized, quantized_case
from .regions import assert_regions_ran, assert_regions_whole, record_regions
from .steps import Case, Inputs, Step, assert_same_step, randn, run_step
from .suite import ConformanceSuite

__all__ = [
    "COMPILED_MARK", "COMPILED_TOLERANCE", "MARKERS", "QUANTIZED_BASES", "Case", "ConformanceSuite", "Inputs",
    "KernelMap", "KernelSite", "ParityReport", "RegionView", "Step", "assert_attention_side_covers_kernels",
    "assert_regions_ran", "assert_regions_whole", "assert_same_step", "assert_seams_hold_no_attention",
    "check_bench_workload", "check_builtin_flag", "check_declared_sides", "check_no_grad", "check_quantized", "check_strategy", "config_id",
    "count_kernels", "count_saved_bytes", "cpu_configs", "locate_kernels", "offload_configs", "pick",
    "preset_model", "pytest_collection_modifyitems", "pytest_configure", "pytest_terminal_summary", "quantized_case",
    "randn",
    "record_regions", "reduced_configs", "reduced_offload_configs", "run_step",
]
