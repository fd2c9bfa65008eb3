"""The pytest suite a plugin subclasses: one test per configuration, so a failure names the configuration.

:class:`ConformanceSuite` turns the checks (:mod:`gradseam.testing.checks`) into pytest tests for one
:class:`~gradseam.testing.Case`, with the configurations derived from the family the case's model
resolves to: the full matrices, or the reduced ones (one row per mechanism) for a case that only varies
the inputs of a model whose plain case runs them all. Collecting a suite registers the kit as a pytest
plugin (:mod:`gradseam.testing.plugin`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any, ClassVar

from ..config import CheckpointConfig
from ..tools.named_strategies import BACKEND, OFFLOAD_ATTENTION, ON
from .checks import check_declared_sides, check_no_grad, check_strategy
from .facts import backends, compiles, moves_to_host, strategy_for
from .matrices import config_id, cpu_configs, offload_configs, reduced_configs, reduced_offload_configs
from .plugin import use_as_pytest_plugin
from .quantized import QUANTIZED_BASES, UnpatchedFailure, check_quantized, unavailable
from .steps import Case


@contextmanager
def _matrix_warnings() -> Iterator[None]:
    """The suite's rows without the warning a row of its own matrix gives by design (``-ffn`` x interval 2:
    the interval only selects blocks through a stride), so a plugin's green run reads with no warning."""
    import warnings

    from ..errors import GradseamWarning

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", r"gradient_checkpointing_interval=\d+ does not group FFN regions",
                                GradseamWarning)
        yield


_FAMILIES: dict[int, tuple[Case, Any]] = {}  # id(case) -> (the case, held so that its id is not reused; its family)


def _over(kind: str) -> Callable[[Callable[..., None]], Callable[..., None]]:
    def mark(test: Callable[..., None]) -> Callable[..., None]:
        test.conformance_configs = kind  # type: ignore[attr-defined]
        return test

    return mark


class ConformanceSuite:
    """Subclass in a plugin's tests and set ``case``; pytest runs one test per configuration.

    Example::

        from gradseam.testing import Case, ConformanceSuite

        class TestMyFamily(ConformanceSuite):
            case = Case("mymodel", build=tiny_model, inputs=tiny_inputs)

    The configurations follow from the family the model resolves to (no ``-ffn`` backends without
    an FFN seam, no interval without a ``Carry``, no attention offload without an attention side).
    Set ``reduced = True`` for a case that varies the inputs of a model another suite runs in full (a
    mask, a batch, a residual): both tests then run one row per mechanism (:func:`reduced_configs`,
    :func:`reduced_offload_configs`); ``reduced_offload = True`` does it for ``test_offload`` alone.
    Override ``configs`` / ``offload`` with explicit lists to choose rows yourself, set ``whole_regions =
    False`` if the case's inputs make chunks fall back on purpose, or ``atol`` to compare with a
    tolerance instead of bit for bit (never needed on the CPU so far).

    ``test_quantized_base`` runs the model with its blocks quantized (LoRA-style training on a quantized,
    frozen base: :mod:`gradseam.testing.quantized`) for each base of ``quantized_bases`` whose library is
    installed (``pip install 'gradseam[quant]'``; skipped, saying so, otherwise); set it to ``()`` to leave
    those rows out, or to other names of :data:`gradseam.tools.bases.BASES`.

    Nothing else to set up: collecting a suite registers the kit as a pytest plugin, which declares
    the ``compiled`` marker of the compiled-backend rows and leaves those rows out unless ``-m`` selects
    them (``-m compiled``).
    """

    case: ClassVar[Case]
    configs: ClassVar[list[dict[str, Any]] | None] = None
    offload: ClassVar[list[dict[str, Any]] | None] = None
    reduced: ClassVar[bool] = False
    reduced_offload: ClassVar[bool | None] = None  # None: as ``reduced``
    whole_regions: ClassVar[bool] = True
    atol: ClassVar[float] = 0.0
    # None: QUANTIZED_BASES for a suite that runs its full matrices, none for a reduced one (an input variant:
    # the quantized rows check the model's weights, which a variant of the inputs does not change)
    quantized_bases: ClassVar[tuple[str, ...] | None] = None
    # what the kit's pytest hooks recognise a suite's tests by (plugin.SUITE_ATTRIBUTE names it)
    gradseam_conformance_suite: ClassVar[bool] = True

    @classmethod
    def family(cls) -> Any:
        """The family the case's model resolves to (the model is built once per case to find it)."""
        key = id(cls.case)
        if key not in _FAMILIES:
            from ..patcher import family_for

            _FAMILIES[key] = (cls.case, family_for(cls.case.fresh()))
        return _FAMILIES[key][1]

    @classmethod
    def strategy_configs(cls) -> list[dict[str, Any]]:
        """The rows of ``test_strategy``: ``configs``, else the family's full or reduced CPU matrix."""
        if cls.configs is not None:
            return cls.configs
        family = cls.family()
        matrix = reduced_configs if cls.reduced else cpu_configs
        return matrix(ffn=family.has_ffn, interval=family.supports_interval)

    @classmethod
    def offload_configs(cls) -> list[dict[str, Any]]:
        """The rows of ``test_offload``: ``offload``, else the family's full or reduced offload matrix."""
        if cls.offload is not None:
            return cls.offload
        family = cls.family()
        reduced = cls.reduced if cls.reduced_offload is None else cls.reduced_offload
        matrix = reduced_offload_configs if reduced else offload_configs
        return matrix(ffn=family.has_ffn, interval=family.supports_interval, attention=family.has_attention)

    @classmethod
    def quantized_configs(cls) -> list[tuple[str, dict[str, Any]]]:
        """The rows of ``test_quantized_base``, as (base, config), drawn from the suite's own rows (so a suite
        that chose its rows gets no other mechanism with a quantized base): whole blocks checkpointed (the
        first row of ``test_strategy`` that moves nothing), offloaded (the first of ``test_offload``), and
        compiled (the suite's compiled row that offloads, else its other one; marked ``compiled``). The
        first base of ``quantized_bases`` runs all three; each further base the offloaded row alone, the one
        that must tell the base's weights from activations in every family (checkpointing alone reads the
        weights as the unpatched model does, and a compiled row costs seconds to minutes per family)."""
        bases = cls.quantized_bases
        if bases is None:
            bases = () if cls.reduced or cls.reduced_offload else QUANTIZED_BASES
        if not bases:
            return []
        from ..tools.bases import BASES

        unknown = [b for b in bases if b not in BASES]
        if unknown:
            raise ValueError(f"{cls.__name__}.quantized_bases names unknown bases {unknown}; the bases are: "
                             f"{', '.join(BASES)}")
        eager = [c for c in cls.strategy_configs() if not compiles(c) and not moves_to_host(strategy_for(c))][:1]
        offload = [c for c in cls.offload_configs() if not compiles(c)][:1]
        compiled = sorted((c for c in cls.strategy_configs() + cls.offload_configs() if compiles(c)),
                          key=lambda c: not moves_to_host(strategy_for(c)))[:1]
        rows = []
        for i, base in enumerate(bases):
            rows += [(base, copy.deepcopy(c)) for c in (eager + offload + compiled if i == 0 else offload)]
        return rows

    def pytest_generate_tests(self, metafunc: Any) -> None:
        use_as_pytest_plugin(metafunc.config)  # the kit's marker, before any test is marked with it
        kind = getattr(metafunc.function, "conformance_configs", None)
        if kind is None or "config" not in metafunc.fixturenames:
            return
        import pytest

        if kind == "quantized":
            rows = self.quantized_configs()
            params = [pytest.param(base, c, marks=[pytest.mark.compiled] if compiles(c) else [],
                                   id=f"{base}-{config_id(c)}") for base, c in rows]
            if not params:  # one skipped row saying why, rather than pytest's "empty parameter set"
                params = [pytest.param(None, None, id="off", marks=pytest.mark.skip(
                    reason="no quantized bases: quantized_bases is empty, as it is by default for a reduced suite "
                           "(an input variant); set it to run the quantized rows"))]
            metafunc.parametrize(("base", "config"), params)
            return
        configs = self.strategy_configs() if kind == "strategy" else self.offload_configs()
        params = [pytest.param(copy.deepcopy(c), marks=[pytest.mark.compiled] if compiles(c) else [])
                  for c in configs]
        metafunc.parametrize("config", params, ids=[config_id(c) for c in configs])

    def test_declaration_matches_the_model(self) -> None:
        """The model resolves to an installed family, every block list the family declares for this model is
        found and every block is planned (a list path or block class that does not match the installed
        diffusers fails here by name), no FFN seam calls an attention kernel, and every kernel a block with an
        attention side calls runs inside that side, and every block submodule the model calls outside its block is
        declared (:func:`check_declared_sides`)."""
        from ..planning import plan, resolve

        family = self.family()
        model = self.case.fresh()
        planned = plan(model, family, CheckpointConfig(gradient_checkpointing=True))
        for block_list in family.block_lists:
            blocks = resolve(model, block_list.path)
            if blocks is None:
                assert block_list.optional, f"{self.case.name}: block list {block_list.path!r} is missing"
                continue
            covered = {i for r in planned.regions if r.list_path == block_list.path for i in r.blocks}
            assert covered == set(range(len(blocks))), (
                f"{self.case.name}: blocks {sorted(set(range(len(blocks))) - covered)} of {block_list.path!r} "
                "are not planned"
            )
        assert planned.regions, f"{self.case.name}: the family plans no region for this model"
        check_declared_sides(self.case)

    @_over("strategy")
    def test_strategy(self, config: dict[str, Any]) -> None:
        """Exact outputs and gradients, less kept memory, an exact ``remove()``, regions that run whole."""
        with _matrix_warnings():
            check_strategy(self.case, config, atol=self.atol, whole=self.whole_regions)

    @_over("offload")
    def test_offload(self, config: dict[str, Any]) -> None:
        """The same through the offload engine (CPU stand-in: host buffers, same copies as on a GPU)."""
        from ..offload import cpu_test_mode

        with cpu_test_mode(), _matrix_warnings():
            check_strategy(self.case, config, atol=self.atol, whole=self.whole_regions)

    @_over("quantized")
    def test_quantized_base(self, base: str, config: dict[str, Any]) -> None:
        """The same with the blocks' Linear layers quantized (frozen) and the rest of the model training, against
        the unpatched quantized twin (:func:`~gradseam.testing.quantized.check_quantized`): quantized weights and
        their inner and side tensors are never offloaded nor counted as kept, and compiled blocks compile with
        them. Skipped when the base's library is missing, or when the quantized model fails unpatched."""
        import pytest

        from ..offload import cpu_test_mode

        why = unavailable(base)
        if why:
            pytest.skip(why)
        mode = cpu_test_mode() if moves_to_host(strategy_for(config)) else nullcontext()
        try:
            with mode, _matrix_warnings():
                check_quantized(self.case, base, config, atol=self.atol, whole=self.whole_regions)
        except UnpatchedFailure as exc:
            pytest.skip(str(exc))

    def test_no_grad(self) -> None:
        """Sampling under ``torch.no_grad()`` is untouched by a patch."""
        check_no_grad(self.case)

    def test_refuses_what_it_cannot_do(self) -> None:
        """Options the family cannot run, or this machine cannot, are refused with the model left untouched:
        offload on a CPU model (outside the test mode) for every family, the ``-ffn`` backends without an
        FFN seam, attention offload without an attention side."""
        import gradseam

        from ..errors import UnsupportedStrategyError

        family = self.family()
        refused: list[dict[str, Any]] = [{**ON, BACKEND: b.name} for b in backends() if b.moves]
        refused.append({OFFLOAD_ATTENTION: True})
        if not family.has_ffn:
            refused += [{**ON, BACKEND: b.name} for b in backends() if b.ffn]
        for config in refused:
            model = self.case.fresh()
            before = {name: set(m.__dict__) for name, m in model.named_modules()}
            try:
                gradseam.patch(model, config)
            except UnsupportedStrategyError:
                assert gradseam.handle_of(model) is None
                assert {name: set(m.__dict__) for name, m in model.named_modules()} == before, (
                    f"{self.case.name}: refusing {config_id(config)} left the model changed"
                )
            else:
                raise AssertionError(f"{self.case.name}: {config_id(config)} was accepted, though it cannot run here")
