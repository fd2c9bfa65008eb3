"""What the tests look for on a module: the seam gradseam installed on it, if any (tests only)."""

from __future__ import annotations

from torch import nn

from gradseam.run.seams import SeamForward


def installed_seam(module: nn.Module) -> SeamForward | None:
    """The seam gradseam installed as ``module``'s instance ``forward``, or None."""
    forward = module.__dict__.get("forward")
    return forward if isinstance(forward, SeamForward) else None
