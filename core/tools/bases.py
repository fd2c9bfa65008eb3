"""Quantized bases as trainers make them, for the benchmarks, the tests and the conformance kit.

A LoRA on a quantized base is how most people fit Flux, Wan or Qwen-Image on their cards: diffusers'
DreamBooth scripts quantize with torchao (``--do_fp8_training``) or bitsandbytes NF4, ai-toolkit with
optimum-quanto's qfloat8, musubi and diffusion-pipe train on fp8 bases. gradseam patches such a
model like any other (docs/strategies.md says which backend suits which base); this module only
*makes* one, in place, the way each library's own API does, so a benchmark or a test can measure or
check gradseam on it. Each :class:`Base` quantizes the ``nn.Linear`` layers of the modules it is
given (the blocks: where nearly all of a transformer's weights are) and freezes them; the library is
imported when a base is applied, so nothing here needs it installed (``pip install gradseam[quant]``).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import GradseamError


@dataclass(frozen=True)
class Base:
    """One way to quantize a frozen base: ``apply(modules, dtype)`` quantizes the Linear layers of each
    module in place (``dtype``: the compute dtype the rest of the model runs in)."""

    name: str
    library: str  # the import name of the library that makes it
    words: str  # what it is, for tables and errors
    apply: Callable[[list[nn.Module], torch.dtype], None]

    def available(self) -> bool:
        # find_spec of a dotted name imports its parent first, and raises where the parent is missing
        # ("optimum.quanto" without optimum: the GPU suite failed instead of skipping, 2026-12-05)
        try:
            return importlib.util.find_spec(self.library) is not None
        except ModuleNotFoundError:
            return False


def _linears(modules: Iterable[nn.Module]) -> list[tuple[nn.Module, str, nn.Linear]]:
    """(parent, attribute, layer) for every plain ``nn.Linear`` under ``modules``."""
    found = []
    for module in modules:
        for parent in module.modules():
            for name, child in parent.named_children():
                if type(child) is nn.Linear:
                    found.append((parent, name, child))
    return found


def _torchao(config_name: str) -> Callable[[list[nn.Module], torch.dtype], None]:
    def apply(modules: list[nn.Module], dtype: torch.dtype) -> None:
        import torchao.quantization as tq

        # set_inductor_config=False: by default quantize_ turns inductor's coordinate-descent tuning on for
        # the whole process, which makes a compiled training step's first run take minutes on CUDA
        # (gradseam.run.compiler.TUNING_AT_RUN_TIME); the weights are the same either way
        config = getattr(tq, config_name)(set_inductor_config=False)
        for module in modules:
            tq.quantize_(module, config)
    return apply


def _torchao_float8_training(modules: list[nn.Module], dtype: torch.dtype) -> None:
    """torchao's float8 training recipe (``convert_to_float8_training``, diffusers' ``--do_fp8_training``): the
    weights stay in ``dtype``, every matmul of the Linear layers (forward and both backward ones) runs in
    fp8 with scales taken from each tensor as it comes (dynamic scaling), so a frozen base trains as fast
    as fp8 matmuls allow, at the bf16 base's weight memory."""
    from torchao.float8 import convert_to_float8_training

    for module in modules:
        convert_to_float8_training(module)


def _quanto(weights: str) -> Callable[[list[nn.Module], torch.dtype], None]:
    def apply(modules: list[nn.Module], dtype: torch.dtype) -> None:
        import optimum.quanto as quanto

        for module in modules:
            quanto.quantize(module, weights=getattr(quanto, weights))
            quanto.freeze(module)
    return apply


def _swap_linears(modules: list[nn.Module], make: Callable[[nn.Linear], nn.Module]) -> None:
    """Replace every plain Linear under ``modules`` by ``make(layer)``, quantized on the layer's device.

    bitsandbytes quantizes a weight when it moves to a device, so the new layer is moved there; its
    ``Params4bit`` does nothing for a move to the CPU it is already on, so there it is asked directly."""
    for parent, name, layer in _linears(modules):
        device = layer.weight.device
        new = make(layer)
        if layer.bias is not None:
            new.bias = nn.Parameter(layer.bias.data, requires_grad=False)
        weight = new.weight
        if device.type == "cpu" and hasattr(weight, "_quantize") and not getattr(weight, "bnb_quantized", True):
            new.weight = weight._quantize(device)
        setattr(parent, name, new.to(device))


def _bnb_4bit(quant_type: str) -> Callable[[list[nn.Module], torch.dtype], None]:
    def apply(modules: list[nn.Module], dtype: torch.dtype) -> None:
        import bitsandbytes as bnb

        def make(layer: nn.Linear) -> nn.Module:
            new = bnb.nn.Linear4bit(layer.in_features, layer.out_features, bias=layer.bias is not None,
                                    compute_dtype=dtype, quant_type=quant_type, device="meta")
            new.weight = bnb.nn.Params4bit(layer.weight.data, requires_grad=False, quant_type=quant_type)
            return new

        _swap_linears(modules, make)
    return apply


def _bnb_8bit(modules: list[nn.Module], dtype: torch.dtype) -> None:
    import bitsandbytes as bnb

    def make(layer: nn.Linear) -> nn.Module:
        new = bnb.nn.Linear8bitLt(layer.in_features, layer.out_features, bias=layer.bias is not None,
                                  has_fp16_weights=False, device="meta")
        # Int8Params quantizes as it moves to a device (the CPU included): start from the host copy
        new.weight = bnb.nn.Int8Params(layer.weight.data.to("cpu"), requires_grad=False, has_fp16_weights=False)
        return new

    _swap_linears(modules, make)


BASES: dict[str, Base] = {b.name: b for b in (
    Base("torchao-fp8", "torchao", "torchao fp8 weight-only (Float8WeightOnlyConfig)", _torchao("Float8WeightOnlyConfig")),
    Base("torchao-int8", "torchao", "torchao int8 weight-only (Int8WeightOnlyConfig)", _torchao("Int8WeightOnlyConfig")),
    Base("torchao-float8-training", "torchao", "torchao float8 training (convert_to_float8_training)",
         _torchao_float8_training),
    Base("quanto-qfloat8", "optimum.quanto", "optimum-quanto qfloat8 weights", _quanto("qfloat8")),
    Base("quanto-qint8", "optimum.quanto", "optimum-quanto qint8 weights", _quanto("qint8")),
    Base("bnb-nf4", "bitsandbytes", "bitsandbytes NF4 (Linear4bit)", _bnb_4bit("nf4")),
    Base("bnb-fp4", "bitsandbytes", "bitsandbytes FP4 (Linear4bit)", _bnb_4bit("fp4")),
    Base("bnb-int8", "bitsandbytes", "bitsandbytes LLM.int8 (Linear8bitLt)", _bnb_8bit),
)}


def quantize(modules: Iterable[nn.Module], base: str, dtype: torch.dtype) -> Base:
    """Quantize the Linear layers of ``modules`` in place as ``base`` makes them, and freeze them."""
    found = BASES.get(base)
    if found is None:
        raise GradseamError(f"unknown base {base!r}; the quantized bases are: {', '.join(BASES)}.")
    if not found.available():
        raise GradseamError(f"base {base!r} needs {found.library.split('.')[-1]}: pip install 'gradseam[quant]'.")
    modules = list(modules)
    found.apply(modules, dtype)
    for module in modules:
        module.requires_grad_(False)
    return found


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and buffers as they sit in memory: a quantized weight's inner
    tensors and side tensors (block scales), not its nominal full-precision size."""
    from ..offload.state import state_bytes

    return state_bytes([*model.parameters(), *model.buffers()])


LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0")  # diffusers' attention projections, as its LoRA scripts train


def add_lora(model: nn.Module, rank: int, dtype: torch.dtype, targets: Iterable[str] = LORA_TARGETS) -> int:
    """A PEFT LoRA of ``rank`` on the attention projections (``targets``), in ``dtype``, as the only trainable
    parameters; returns their number. PEFT picks its layer for each base (bitsandbytes', torchao's or
    the plain one)."""
    try:
        from peft import LoraConfig, inject_adapter_in_model
    except ImportError as exc:
        raise GradseamError("a LoRA needs peft: pip install peft.") from exc
    model.requires_grad_(False)
    inject_adapter_in_model(LoraConfig(r=rank, lora_alpha=rank, target_modules=list(targets)), model)
    trainable = [p for name, p in model.named_parameters() if "lora_" in name]
    if not trainable:
        raise GradseamError(f"no LoRA target ({', '.join(targets)}) found in {type(model).__name__}.")
    for p in trainable:
        p.data = p.data.to(dtype)
        p.requires_grad_(True)
    return sum(p.numel() for p in trainable)
