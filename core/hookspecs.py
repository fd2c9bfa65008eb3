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
