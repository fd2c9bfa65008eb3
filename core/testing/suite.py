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
from contextlib import contextmanager
from typing import Any, ClassVar

from ..config import CheckpointConfig
from ..tools.named_strategies import BACKEND, OFFLOAD_ATTENTION, ON
from .checks import check_declared_sides, check_no_grad, check_strategy
from .facts import backends, compiles
from .matrices import config_id, cpu_configs, offload_configs, reduced_configs, reduced_offload_configs
from .plugin import use_as_pytest_plugin
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

    def pytest_generate_tests(self, metafunc: Any) -> None:
        use_as_pytest_plugin(metafunc.config)  # the kit's marker, before any test is marked with it
        kind = getattr(metafunc.function, "conformance_configs", None)
        if kind is None or "config" not in metafunc.fixturenames:
            return
        import pytest

        configs = self.strategy_configs() if kind == "strategy" else self.offload_configs()
        params = [pytest.param(copy.deepcopy(c), marks=[pytest.mark.compiled] if compiles(c) else [])
                  for c in configs]
        metafunc.parametrize("config", params, ids=[config_id(c) for c in configs])

    def test_declaration_matches_the_model(self) -> None:
        """The model resolves to an installed family, every block list the family declares for this model is
        found and every block is planned (a list path or block class that does not match the installed
        diffusers fails here by name), no FFN seam calls an attention kernel, and every kernel a block with an
        attention side calls runs inside that side (:func:`check_declared_sides`)."""
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
