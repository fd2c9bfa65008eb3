"""A LoRA on a quantized base, on the CPU: the way most people train Flux and Wan (torchao fp8/int8,
optimum-quanto qfloat8/qint8, bitsandbytes NF4/FP4/int8; :mod:`gradseam.tools.bases` makes each).

For the tiny Flux and Wan and every base whose library is installed: a peft LoRA on ``to_q``/``to_v``
trains over the frozen quantized blocks, and every mechanism of the kit's reduced matrices (whole
blocks, FFN seams, kept attention; the same offloaded in the CPU test mode) and the compiled backends
(once per kind of quantized weight, see COMPILED_ROWS) give the unpatched quantized twin's step, to the
bit (the compiled tolerance for compiled rows).
Then what only a quantized base can break: the offload engine never copies a weight's bytes (its
inner tensors and side tensors included), and the saved-bytes count leaves them out; the same
through diffusers' own quantizers (``from_pretrained(quantization_config=...)`` under
``gradseam.patching``); and diffusers' layerwise casting, exact with the eager backends and refused
by the compiled ones.

The quick subset keeps each test's first row (tests/conftest.py lists this file with the matrix files).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from cases import FLUX, WAN

import gradseam
from gradseam.errors import UnsupportedStrategyError
from gradseam.offload import cpu_test_mode
from gradseam.offload import engine as engine_module
from gradseam.offload.engine import OffloadEngine
from gradseam.offload.state import state_storages
from gradseam.patcher import family_for
from gradseam.testing import (
    COMPILED_TOLERANCE,
    Case,
    assert_same_step,
    config_id,
    count_saved_bytes,
    cpu_configs,
    offload_configs,
    reduced_configs,
    reduced_offload_configs,
    run_step,
)
from gradseam.testing.facts import compiles, moves_to_host, strategy_for
from gradseam.testing.quantized import check_quantized, quantized_case, unavailable
from gradseam.tools.bases import BASES
from gradseam.tools.named_strategies import BACKEND

ON = {"gradient_checkpointing": True}
CASES = [FLUX, WAN]
COMPILE = {**ON, "gradient_checkpointing_backend": "compile"}
UNSLOTH = {**ON, "gradient_checkpointing_backend": "unsloth"}
UNSLOTH_COMPILE = {**ON, "gradient_checkpointing_backend": "unsloth-compile"}
ATTENTION_OFFLOAD = {"gradient_checkpointing_offload_attention": True}


def lora(model: torch.nn.Module) -> None:
    """The trainable part: a peft LoRA on the attention projections, over a frozen base (non-zero B, so
    it changes the outputs and every LoRA weight gets a gradient)."""
    import peft

    model.requires_grad_(False)
    model.add_adapter(peft.LoraConfig(r=2, lora_alpha=2, target_modules=["to_q", "to_v"], init_lora_weights=False))


def need(base: str) -> None:
    """Skip, naming the library, when ``base`` cannot run here."""
    why = unavailable(base)
    if why:
        pytest.skip(why)


# Compiled rows cost 2-4 s each on a CPU, so they run where they can tell something new: once per kind of
# quantized weight (a base whose weights are the tensor class of another's, quanto-qint8 as quanto-qfloat8's,
# bnb-fp4 as bnb-nf4's, adds nothing) with ``unsloth-compile`` on Flux, whose single-stream block returns two
# slices of one tensor (what made compiling blocks with subclass weights fail) and whose compiled blocks keep
# the most; ``compile`` on Flux for the two wrapper subclasses; ``unsloth-compile`` on Wan for the wrapper
# subclasses, whose inner tensors its compiled blocks save (bitsandbytes' graphs save none of its scales).
COMPILED_ROWS = {
    FLUX.name: {"unsloth-compile": ("torchao-fp8", "torchao-int8", "torchao-float8-training", "quanto-qfloat8",
                                    "bnb-nf4", "bnb-int8"),
                "compile": ("torchao-fp8", "quanto-qfloat8")},
    WAN.name: {"unsloth-compile": ("torchao-fp8", "torchao-int8", "torchao-float8-training", "quanto-qfloat8",
                                   "bnb-nf4", "bnb-int8")},
}
# Of those, the rows another test covers run under `-m compiled` only (pyproject.toml deselects the mark by
# default), to keep the suite within CI's time. ``compile`` on Flux is covered by the same base's
# flux-...-unsloth-compile row of this test: both backends run one compiled function per block
# (gradseam.run.compiled), ``unsloth-compile`` only adds the offload group around its call; what ``compile``'s
# blocks keep of a wrapper weight (its inner tensors) is left out of the count, which
# test_the_saved_bytes_count_leaves_quantized_weights_out checks for both wrapper libraries.
# flux-torchao-fp8-unsloth-compile is covered by wan-torchao-fp8-unsloth-compile (the base and backend) and
# flux-torchao-int8-unsloth-compile (Flux's two slices of one tensor over a torchao wrapper weight); Flux's
# unsloth-compile rows over float8 training, quanto qfloat8 and the two bitsandbytes bases by Wan's rows of the
# same base and backend, which compile one block class instead of two (about half the time on a 2-core runner).
# wan-torchao-int8-unsloth-compile is covered by flux-torchao-int8-unsloth-compile (the same base and backend, over
# Flux's two slices of one tensor) and by wan-torchao-fp8-unsloth-compile (a torchao wrapper's inner tensors saved by
# Wan's compiled blocks).
COVERED_COMPILED_ROWS = {(FLUX.name, "compile", "torchao-fp8"), (FLUX.name, "compile", "quanto-qfloat8"),
                         *((FLUX.name, "unsloth-compile", base) for base in
                           ("torchao-fp8", "torchao-float8-training", "quanto-qfloat8", "bnb-nf4", "bnb-int8")),
                         (WAN.name, "unsloth-compile", "torchao-int8")}


def _rows() -> list:
    """case x base x (the reduced CPU rows, the reduced offload rows, the compiled rows of COMPILED_ROWS): one
    offloaded row per base in the quick subset (on Flux and Wan in turn), the rest marked slow."""
    params = []
    for case in CASES:
        family = family_for(case.fresh())
        flags = {"ffn": family.has_ffn, "interval": family.supports_interval}
        offload = reduced_offload_configs(**flags, attention=family.has_attention)
        compiled = [c for c in cpu_configs(**flags) + offload_configs(**flags, attention=family.has_attention)
                    if compiles(c)]
        for base in BASES:
            rows = [*reduced_configs(**flags), *offload,
                    *(c for c in compiled if base in COMPILED_ROWS[case.name].get(c[BACKEND], ()))]
            for config in rows:
                covered = compiles(config) and (case.name, config[BACKEND], base) in COVERED_COMPILED_ROWS
                params.append(pytest.param(case, base, config, id=f"{case.name}-{base}-{config_id(config)}",
                                           marks=[pytest.mark.compiled] if covered else []))
    return params


@pytest.fixture
def copies(monkeypatch):
    """Every copy the offload engine makes, as it makes it: (bytes, whether the source storage holds any
    byte of the watched model's state). The state is read at copy time, through every parameter's and
    buffer's inner and side tensors (:func:`gradseam.offload.state.state_storages`, bound here, so a test
    that swaps the engine's own reading still sees the real state)."""
    found: list[tuple[int, bool]] = []
    real = OffloadEngine._copy_out
    real_state = state_storages

    def recording(self, group, t, storage, lo, hi):
        model = self._model() if self._model is not None else None
        state = real_state([*model.parameters(), *model.buffers()]) if model is not None else set()
        found.append((hi - lo, storage.data_ptr() in state))
        return real(self, group, t, storage, lo, hi)

    monkeypatch.setattr(OffloadEngine, "_copy_out", recording)
    return found


def assert_no_weight_copied(found: list[tuple[int, bool]], what: str) -> None:
    assert found, f"{what}: the offload engine copied nothing"
    weights = [n for n, state in found if state]
    assert not weights, (f"{what}: the offload engine copied {len(weights)} tensors of the model's weights "
                         f"({sum(weights)} bytes) to host memory")


# -- a LoRA over each base, every mechanism once ----------------------------------------------------------

@pytest.mark.parametrize(("case", "base", "config"), _rows())
def test_lora_on_a_quantized_base_is_exact(case: Case, base: str, config: dict, copies):
    need(base)
    pytest.importorskip("peft")
    moves = moves_to_host(strategy_for(config))
    with cpu_test_mode() if moves else contextlib.nullcontext():
        report = check_quantized(case, base, config, train=lora, whole=True)
    assert any("lora" in name for name in report.patched.param_grads), "the LoRA got no gradient"
    if moves:
        assert_no_weight_copied(copies, f"{case.name}+{base} {config_id(config)}")


# -- what the engine copies and what the count counts ----------------------------------------------------

INNER = {  # where each library keeps a quantized weight's bytes, read here without gradseam's help
    "torchao": lambda w: [w.qdata, w.scale],
    "optimum.quanto": lambda w: [w._data, w._scale],
    "bitsandbytes": lambda w: ([w.quant_state.absmax] + ([w.quant_state.state2.absmax] if w.quant_state.nested else [])
                               if getattr(w, "quant_state", None) is not None else [w.SCB]),
}


# torchao's float8 training recipe keeps plain weights (it casts them to fp8 per matmul): nothing inside to find
STORED_QUANTIZED = [b for b in BASES if b != "torchao-float8-training"]


@pytest.mark.parametrize("base", STORED_QUANTIZED)
def test_the_state_holds_every_inner_and_side_tensor_of_a_quantized_weight(base):
    """The engine's and the count's view of the model's state holds the bytes of every quantized weight:
    a wrapper subclass's inner tensors (torchao's qdata/scale, quanto's _data/_scale) and the block scales
    bitsandbytes hangs on the parameter (absmax, SCB), which the parameter's own storage does not."""
    need(base)
    model = quantized_case(WAN, base).fresh()
    state = state_storages([*model.parameters(), *model.buffers()])
    weights = [m.weight for b in model.blocks for m in b.modules()
               if isinstance(getattr(m, "weight", None), torch.Tensor) and type(m.weight) is not torch.nn.Parameter]
    assert weights, f"{base}: no quantized weight found"
    for w in weights:
        for part in INNER[BASES[base].library](w):
            assert part.untyped_storage().data_ptr() in state, f"{base}: a {tuple(part.shape)} part of a weight is not state"


def _naive_state_storages(tensors) -> set[int]:
    """The engine's state check before it looked inside quantized weights: each parameter's own storage."""
    found = set()
    for t in tensors:
        with contextlib.suppress(RuntimeError):  # a wrapper subclass has no storage of its own
            found.add(t.untyped_storage().data_ptr())
    found.discard(0)
    return found


@pytest.mark.parametrize(("case", "base", "config"), [
    pytest.param(WAN, "torchao-int8", ATTENTION_OFFLOAD, id="wan-torchao-int8-attention-offload"),
    pytest.param(FLUX, "torchao-int8", ATTENTION_OFFLOAD, id="flux-torchao-int8-attention-offload"),
    pytest.param(WAN, "torchao-fp8", UNSLOTH_COMPILE, id="wan-torchao-fp8-unsloth-compile"),
    pytest.param(WAN, "quanto-qfloat8", UNSLOTH_COMPILE, id="wan-quanto-qfloat8-unsloth-compile"),
    pytest.param(WAN, "torchao-int8", UNSLOTH, id="wan-torchao-int8-unsloth"),
])
def test_the_offload_engine_copies_no_byte_of_a_quantized_weight(case, base, config, copies, monkeypatch):
    """No storage holding a weight's bytes is ever copied to host memory, and something is. Where the
    regions save a weight's inner tensors (torchao's int8 matmul saves qdata in eager attention; a compiled
    block saves the inner tensors of torchao and quanto weights) the same run with the engine's old,
    per-parameter state check copies weights, and this test's recorder sees them: it cannot pass by
    seeing nothing."""
    need(base)
    qcase = quantized_case(case, base)

    def step() -> None:
        model = qcase.fresh()
        with cpu_test_mode(), gradseam.patch(model, config) as handle:
            run_step(model, qcase)
            assert sum(n for n, _ in copies) == handle.engine.offloaded_bytes

    what = f"{qcase.name} {config_id(config)}"
    step()
    assert_no_weight_copied(copies, what)
    wrapper = base.split("-")[0] in ("torchao", "quanto")
    saves_inner = (compiles(config) and wrapper) or (base == "torchao-int8" and config == ATTENTION_OFFLOAD)
    if saves_inner:
        copies.clear()
        monkeypatch.setattr(engine_module, "state_storages", _naive_state_storages)
        step()
        assert any(state for _, state in copies), (
            f"{what}: with a per-parameter state check the engine copied no weight: the recorder cannot tell")


@pytest.mark.parametrize("base", ["torchao-int8", "quanto-qfloat8"])
def test_the_saved_bytes_count_leaves_quantized_weights_out(base):
    """A compiled block saves the inner tensors of its quantized weights for backward (plain tensors, no
    parameter's views): ``count_saved_bytes`` counts every saved storage but those, as a count that knew
    only the parameters' own storages would not."""
    need(base)
    qcase = quantized_case(WAN, base)
    model = qcase.fresh()
    state = state_storages([*model.parameters(), *model.buffers()])
    params = {id(p) for p in model.parameters()}
    saved: dict[int, int] = {}

    def record(t: torch.Tensor) -> torch.Tensor:
        from gradseam.offload.state import plain_parts

        for part in plain_parts(t):
            storage = part.untyped_storage()
            if storage.nbytes():
                saved[storage.data_ptr()] = storage.nbytes()
        return t.detach()

    def naive(t: torch.Tensor) -> torch.Tensor:  # the count before it looked inside quantized weights
        if id(t) not in params and not (t._base is not None and id(t._base) in params):
            with contextlib.suppress(RuntimeError):  # a wrapper subclass has no storage of its own
                storage = t.untyped_storage()
                naive_seen[storage.data_ptr()] = storage.nbytes()
        return t.detach()

    naive_seen: dict[int, int] = {}
    x = WAN.inputs(torch.Generator().manual_seed(1))
    with gradseam.patch(model, COMPILE):
        model(**x)[0].square().mean().backward()  # compiles
        with torch.autograd.graph.saved_tensors_hooks(record, lambda t: t):  # every storage saved
            out = model(**WAN.inputs(torch.Generator().manual_seed(1)))[0]
        out.square().mean().backward()
        with count_saved_bytes(model) as counted:
            out = model(**WAN.inputs(torch.Generator().manual_seed(1)))[0]
        out.square().mean().backward()
        with torch.autograd.graph.saved_tensors_hooks(naive, lambda t: t):
            out = model(**WAN.inputs(torch.Generator().manual_seed(1)))[0]
        out.square().mean().backward()
    own = _naive_state_storages([*model.parameters(), *model.buffers()])
    inner = {ptr: n for ptr, n in saved.items() if ptr in state and ptr not in own}
    assert inner, f"{base}: the compiled blocks saved no inner tensor of a quantized weight: nothing to leave out"
    assert counted[0] == sum(n for ptr, n in saved.items() if ptr not in state), (
        f"{base}: count_saved_bytes counted {counted[0]} bytes, the saved storages that are not the model's state "
        f"hold {sum(n for ptr, n in saved.items() if ptr not in state)} (the weights' inner tensors: {sum(inner.values())})")
    assert sum(naive_seen.values()) >= counted[0] + sum(inner.values()), "a per-parameter count counts them"


# -- through diffusers' own quantizers ------------------------------------------------------------------

def _quantization_config(quantizer: str):
    import diffusers

    if quantizer == "torchao-int8":
        from torchao.quantization import Int8WeightOnlyConfig

        return diffusers.TorchAoConfig(Int8WeightOnlyConfig())
    return diffusers.QuantoConfig(weights_dtype="float8")


@pytest.fixture(scope="module")
def saved_flux(tmp_path_factory):
    where = tmp_path_factory.mktemp("flux")
    FLUX.fresh().save_pretrained(where)
    return where


@pytest.mark.parametrize("quantizer", ["torchao-int8", "quanto-float8"])
@pytest.mark.parametrize("config", [
    pytest.param({**ON, "gradient_checkpointing_interval": 2}, id="torch+interval2"),
    pytest.param(UNSLOTH, id="unsloth"),
    # under `-m compiled` only: the loaded blocks' weights are the bases' own classes (torchao's Int8Tensor,
    # quanto's WeightQBytesTensor), whose compiled rows on Flux are test_lora_on_a_quantized_base_is_exact's
    # flux-torchao-int8-unsloth-compile and flux-quanto-qfloat8-unsloth-compile; the load under patching is the
    # rows above
    pytest.param(UNSLOTH_COMPILE, id="unsloth-compile", marks=pytest.mark.compiled),
])
def test_a_model_diffusers_quantized_as_it_loads_is_patched_and_exact(saved_flux, quantizer, config):
    """``from_pretrained(quantization_config=...)`` under ``gradseam.patching``: the loaded model is patched,
    and a LoRA trained on it steps as on the same load unpatched (bitsandbytes loads through diffusers on
    a GPU only)."""
    pytest.importorskip("torchao" if quantizer.startswith("torchao") else "optimum.quanto")
    pytest.importorskip("peft")
    from diffusers import FluxTransformer2DModel

    def load() -> torch.nn.Module:
        return FluxTransformer2DModel.from_pretrained(saved_flux, torch_dtype=torch.float32,
                                                      quantization_config=_quantization_config(quantizer))

    def trained(model: torch.nn.Module) -> torch.nn.Module:
        torch.manual_seed(3)
        lora(model)
        return model

    want = run_step(trained(load()), FLUX)
    moves = moves_to_host(strategy_for(config))
    with cpu_test_mode() if moves else contextlib.nullcontext():
        with gradseam.patching(config) as handles:
            model = load()
        assert len(handles) == 1 and gradseam.handle_of(model) is handles[0]
        weight = model.transformer_blocks[0].attn.to_q.weight
        assert type(weight) is not torch.nn.Parameter, "the load did not quantize"
        got = run_step(trained(model), FLUX)
        if moves:
            assert handles[0].engine.offloaded_bytes > 0
    assert_same_step(want, got, atol=COMPILED_TOLERANCE if compiles(config) else 0.0,
                     what=f"{quantizer} load {config_id(config)}")
    handles[0].remove()


# -- diffusers' layerwise casting ----------------------------------------------------------------------

def _cast(case: Case) -> Case:
    """``case`` stored in fp8 and computed in fp32 by diffusers' layerwise casting, a LoRA on top."""

    def build() -> torch.nn.Module:
        model = case.build()
        lora(model)  # first (diffusers leaves peft layers out of the casting); added later, peft stores it in fp8
        model.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.float32)
        return model

    return Case(f"{case.name}-fp8-cast", build, case.inputs, case.output, case.seed)


def _eager_rows() -> list:
    params = []
    for case in CASES:
        family = family_for(case.fresh())
        flags = {"ffn": family.has_ffn, "interval": family.supports_interval}
        rows = [*reduced_configs(**flags), *reduced_offload_configs(**flags, attention=family.has_attention)]
        params += [pytest.param(case, c, id=f"{case.name}-{config_id(c)}") for c in rows]
    return params


@pytest.mark.parametrize(("case", "config"), _eager_rows())
def test_layerwise_casting_is_exact_with_the_eager_backends(case, config):
    pytest.importorskip("peft")
    cast = _cast(case)
    want = run_step(cast.fresh(), cast)
    model = cast.fresh()
    assert any(p.dtype == torch.float8_e4m3fn for p in model.parameters()), "nothing is stored in fp8"
    mode = cpu_test_mode() if moves_to_host(strategy_for(config)) else contextlib.nullcontext()
    with mode, gradseam.patch(model, config) as handle:
        got = run_step(model, cast)
        if handle.engine is not None:
            assert handle.engine.offloaded_bytes > 0
    assert_same_step(want, got, what=f"{cast.name} {config_id(config)}")


@pytest.mark.parametrize("config", [COMPILE, UNSLOTH_COMPILE], ids=config_id)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_the_compiled_backends_refuse_layerwise_casting_at_patch_time(case, config):
    pytest.importorskip("peft")
    cast = _cast(case)
    model = cast.fresh()
    backend = config["gradient_checkpointing_backend"]
    with cpu_test_mode(), pytest.raises(UnsupportedStrategyError) as refused:
        gradseam.patch(model, config)
    message = str(refused.value)
    assert "layerwise casting" in message and repr(backend) in message, message
    assert "Use an eager backend" in message and "model.to(torch.bfloat16)" in message, message  # the fix
    assert gradseam.handle_of(model) is None


def _marlin_stand_in() -> type:
    """A parameter class named and placed as optimum-quanto's Marlin fp8 weight (quanto makes the real one
    only on a CUDA GPU, with a kernel it builds there)."""
    return type("MarlinF8QBytesTensor", (torch.nn.Parameter,), {"__module__": "optimum.quanto.tensor.weights.marlin"})


@pytest.mark.parametrize("when", ["at-patch-time", "before-the-first-compile"])
def test_the_compiled_backends_refuse_quanto_marlin_weights(when):
    """quanto packs qfloat8 weights as Marlin tensors on a GPU, whose kernel dynamo cannot trace: refused at
    patch time, and before a compile when the packing happens after patching (the model moved to the GPU)."""
    model = FLUX.fresh()
    block = model.transformer_blocks[0]

    def pack() -> None:
        block.ff.net[2].weight = _marlin_stand_in()(block.ff.net[2].weight.detach())

    if when == "at-patch-time":
        pack()
        with pytest.raises(UnsupportedStrategyError) as refused:
            gradseam.patch(model, UNSLOTH_COMPILE)
        assert gradseam.handle_of(model) is None
    else:
        with cpu_test_mode(), gradseam.patch(model, UNSLOTH_COMPILE):
            pack()
            with pytest.raises(UnsupportedStrategyError) as refused:
                run_step(model, FLUX)
    message = str(refused.value)
    assert "'unsloth-compile'" in message and "Marlin" in message and "ff.net.2.weight" in message, message
    assert "'unsloth' with gradient_checkpointing_offload_attention" in message and "torchao" in message  # the fixes


@pytest.mark.parametrize(("base", "int8"), [("torchao-int8", True), ("quanto-qint8", True), ("torchao-fp8", False)])
def test_blocks_with_int8_weights_compile_without_inductors_pattern_matcher(base, int8, monkeypatch):
    """torchao's int8 weights failed to lower in inductor's pattern rewrites on the H200 (Flux dev, budget
    below 1): their blocks get a compiled function without them, other quantized blocks keep them."""
    need(base)
    from gradseam.run import compiled as compiled_module

    asked = []
    real = compiled_module.compile_block_function

    def recording(function, device, *, pattern_matcher=True):
        asked.append(pattern_matcher)
        return real(function, device, pattern_matcher=pattern_matcher)

    monkeypatch.setattr(compiled_module, "compile_block_function", recording)
    case = quantized_case(WAN, base)
    model = case.fresh()
    with gradseam.patch(model, COMPILE):
        run_step(model, case)
    assert asked == [not int8], asked

# -- the kit's optional row: ConformanceSuite.test_quantized_base ----------------------------------------

def test_the_kits_quantized_rows_follow_the_suite():
    """A plain suite runs the first base checkpointed, offloaded and compiled, the second offloaded; an input
    variant (reduced) or ``quantized_bases = ()`` none; a suite that chose its own rows no other mechanism;
    an unknown base is an error naming the bases."""
    from gradseam.testing import ConformanceSuite, pick

    def ids(suite) -> list[str]:
        return [f"{base}-{config_id(c)}" for base, c in suite.quantized_configs()]

    class Plain(ConformanceSuite):
        case = WAN

    class Variant(ConformanceSuite):
        case = WAN
        reduced_offload = True

    class Off(ConformanceSuite):
        case = WAN
        quantized_bases = ()

    class Chosen(ConformanceSuite):
        case = WAN
        configs = pick(cpu_configs(), {BACKEND: "torch-ffn"})
        offload = pick(offload_configs(), {BACKEND: "unsloth-ffn"})
        quantized_bases = ("quanto-qint8",)

    class Unknown(ConformanceSuite):
        case = WAN
        quantized_bases = ("torchao-int3",)

    assert ids(Plain) == ["torchao-int8-torch", "torchao-int8-unsloth", "torchao-int8-unsloth-compile",
                          "bnb-nf4-unsloth"]
    assert ids(Variant) == ids(Off) == []
    assert ids(Chosen) == ["quanto-qint8-torch-ffn", "quanto-qint8-unsloth-ffn"]
    with pytest.raises(ValueError, match=r"Unknown.quantized_bases names unknown bases \['torchao-int3'\]; the bases"):
        Unknown.quantized_configs()


def test_a_quantized_row_without_its_library_is_skipped_naming_the_extra(monkeypatch):
    import dataclasses

    from gradseam.testing import ConformanceSuite

    class Plain(ConformanceSuite):
        case = WAN

    monkeypatch.setitem(BASES, "bnb-nf4", dataclasses.replace(BASES["bnb-nf4"], library="gradseam_no_such_library"))
    with pytest.raises(pytest.skip.Exception, match=r"needs gradseam_no_such_library, which is not installed: "
                                                    r"pip install 'gradseam\[quant\]'"):
        Plain().test_quantized_base("bnb-nf4", UNSLOTH)


def test_the_torchao_bases_leave_inductors_tuning_as_it_was():
    """torchao's quantize_ turns coordinate-descent tuning on for the whole process by default, which made the
    H200's first compiled step take minutes; the bases quantize without touching it."""
    need("torchao-int8")
    from torch._inductor import config as inductor_config

    with inductor_config.patch(coordinate_descent_tuning=False):
        for name in ("torchao-fp8", "torchao-int8"):
            BASES[name].apply([torch.nn.Sequential(torch.nn.Linear(64, 64))], torch.float32)
            assert inductor_config.coordinate_descent_tuning is False, name


@pytest.mark.parametrize("device", ["cuda", "cpu"], ids=["gpu-blocks", "cpu-blocks"])
def test_compiled_blocks_name_run_time_tuning_once_before_a_cuda_compile(device, monkeypatch):
    import warnings

    from torch._inductor import config as inductor_config

    from gradseam import errors
    from gradseam.run.compiler import TUNING_AT_RUN_TIME, warn_tuning_at_run_time

    monkeypatch.setattr(errors, "warned", set())
    for tuning in (False, True):
        with inductor_config.patch(coordinate_descent_tuning=tuning), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            warn_tuning_at_run_time(device)
            warn_tuning_at_run_time(device)
        said = [str(w.message) for w in caught].count(TUNING_AT_RUN_TIME)
        assert said == (1 if tuning and device == "cuda" else 0), (tuning, said)
    assert "set_inductor_config=False" in TUNING_AT_RUN_TIME


@pytest.mark.parametrize("library", ["gradseam_no_such_parent.quanto", "gradseam_no_such_library"])
def test_a_base_whose_library_or_its_parent_is_missing_is_unavailable(library):
    """``optimum.quanto`` without ``optimum``: ``find_spec`` raises for a dotted name whose parent is missing, and
    the GPU suite failed on that machine instead of skipping."""
    from dataclasses import replace

    assert replace(BASES["quanto-qfloat8"], library=library).available() is False
    assert replace(BASES["quanto-qfloat8"], library="torch.nn").available() is True
