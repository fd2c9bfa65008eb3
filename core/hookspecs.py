"""The plugin contract: the hooks a gradseam plugin may implement.

A plugin is any module or object with functions decorated by :data:`hookimpl`, published under
the ``gradseam`` entry-point group (or passed to :func:`gradseam.register`). The built-in families
are plugins of exactly this kind.
"""

from __future__ import annotations

from collections.abc import Callable

import pluggy

from .family import Family

PROJECT = "gradseam"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

RegisterFamily = Callable[[Family], None]


@hookspec
def register_families(register: RegisterFamily) -> None:
    """Declare model families by calling ``register(Family(...))`` once per family.

    Called once per load, when gradseam first needs the registry (listing families or patching a
    model), or at once for a plugin passed to :func:`gradseam.register`. Return nothing. The
    families are collected first and installed only if the whole hook ran and none of them
    conflicts with an installed family, so raising here leaves nothing of the plugin behind. A
    hookimpl whose name is not a hook declared here (``register_family``) is rejected rather than
    never called. Example::

        from gradseam.family import BlockClass, BlockList, Carry, Family
        from gradseam.hookspecs import hookimpl

        @hookimpl
        def register_families(register):
            register(Family(
                name="mymodel",
                models=("mypkg.models.MyTransformer",),
                block_lists=(BlockList("blocks", carry=Carry({"hidden_states": None})),),
                block_classes=(BlockClass("mypkg.models.MyBlock", ffn=(("ff",),), attention=("attn",)),),
            ))
    """


RegisterKernel = Callable[[str], None]


@hookspec
def register_attention_kernels(register: RegisterKernel) -> None:
    """Name the attention kernels of your model, as operators, by calling ``register("ns::op")``.

    With ``gradient_checkpointing_offload_attention`` (or ``..._keep_attention``) on a whole-block
    backend, gradseam keeps the outputs of attention kernels across the checkpoint instead of
    recomputing them, and it finds attention by operator: aten's scaled-dot-product kernels and
    the custom ops of the libraries diffusers' attention dispatcher routes to are built in
    (:data:`gradseam.registry.BUILTIN_KERNELS`). A model that calls another kernel registered as a
    torch operator (``torch.library.custom_op("mylib::attention", ...)``) names it here; one whose
    kernel is not an operator (a bare Triton launch) is recomputed like any other op, exactly.
    A plugin may implement this hook alone. Example::

        @hookimpl
        def register_attention_kernels(register):
            register("mylib::attention")
    """


RegisterUnsupported = Callable[[str, str], None]


@hookspec
def register_unsupported_models(register: RegisterUnsupported) -> None:
    """Name model classes that no family will handle, and why, by calling ``register("pkg.mod.Class", reason)``.

    A user who patches such a model gets :class:`gradseam.errors.UnsupportedModelError` saying that reason
    (``"a VAE, not a transformer a trainer fine-tunes"``) instead of "no family handles it", and
    ``gradseam families`` lists it. A family that claims the class wins over any such entry, so a third-party
    plugin can take up a class the built-ins left out. A plugin may implement this hook alone. Example::

        @hookimpl
        def register_unsupported_models(register):
            register("mypkg.models.MyVAE", "a VAE: gradseam patches the transformer, not the autoencoder")
    """
