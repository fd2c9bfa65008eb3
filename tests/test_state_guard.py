"""State read again by a recompute: a checkpointed region whose argument is a state object (a KV-cache layer)
recomputes from that object as it is at backward time. Rewritten in between (a cache refilled for the next
chunk before backward), the recompute would compute other values and the gradients would be wrong without a
word: the runner notes the object's tensors as the forward left them and refuses a recompute that finds them
changed, naming the attribute. A region that fills its own state in forward (the reference pass of a KV
cache) recomputes as usual."""

from __future__ import annotations

import pytest
import torch

from gradseam.run.chains import Runner


class Cache:
    """A layer cache as diffusers' KV caches hold one: tensors as plain attributes."""

    def __init__(self, key: torch.Tensor | None = None, mode: str = "cached") -> None:
        self.key = key
        self.mode = mode


def block(x: torch.Tensor, cache: Cache) -> torch.Tensor:
    if cache.mode == "extract":  # the reference pass: store, as a block's attention stores its K/V
        cache.key = (x * 2).detach()
        return x.sin()
    return (x * cache.key).sin()


def _step(cache: Cache, between=None) -> torch.Tensor:
    x = torch.linspace(-1.0, 1.0, 8, requires_grad=True)
    out = Runner()(block, (x,), {"cache": cache})
    if between is not None:
        between(cache)
    out.sum().backward()
    return x.grad


def test_an_untouched_state_recomputes_exactly():
    key = torch.linspace(0.5, 1.5, 8)
    x = torch.linspace(-1.0, 1.0, 8, requires_grad=True)
    block(x, Cache(key.clone())).sum().backward()
    assert torch.equal(_step(Cache(key.clone())), x.grad)


def test_a_region_that_fills_its_own_state_recomputes_as_usual():
    cache = Cache(mode="extract")
    grad = _step(cache)
    assert cache.key is not None and torch.equal(grad, torch.linspace(-1.0, 1.0, 8).cos())
    refilled = Cache(torch.zeros(8), mode="extract")  # a later step refills the cache it filled before
    assert torch.equal(_step(refilled), grad) and torch.equal(refilled.key, torch.linspace(-2.0, 2.0, 8))


@pytest.mark.parametrize(("rewrite", "how"), [
    (lambda cache: cache.key.mul_(3), "written in place"),
    (lambda cache: setattr(cache, "key", torch.ones(8)), "replaced"),
])
def test_a_state_rewritten_before_backward_is_refused_naming_it(rewrite, how):
    with pytest.raises(RuntimeError) as info:
        _step(Cache(torch.linspace(0.5, 1.5, 8)), between=rewrite)
    message = str(info.value)
    assert f"cache.key was {how} after this checkpointed region's forward" in message
    assert "gradients would be wrong" in message and "gradient_checkpointing: false" in message


class Appending:
    """A cache that appends what a block stores, as GLM-Image's layer cache does in "write" mode."""

    def __init__(self) -> None:
        self.keys: list[torch.Tensor] = []
        self.slot: torch.Tensor | None = None


def appending_block(x: torch.Tensor, cache: Appending) -> torch.Tensor:
    cache.keys.append(x.detach() * 2)
    cache.slot = x.detach()  # a capture slot, as SANA-WM's refiner fills one
    return x.sin()


@pytest.mark.parametrize("inside_a_dict", [False, True])
def test_what_a_recompute_does_to_a_state_object_is_undone(inside_a_dict):
    """The unpatched block ran once: its cache holds one entry, and a slot the caller emptied after the forward
    stays empty. A recompute runs the block again; what it stores is put back when it returns."""
    cache = Appending()
    x = torch.linspace(-1.0, 1.0, 8, requires_grad=True)
    if inside_a_dict:
        out = Runner()(lambda x, kw: appending_block(x, kw["cache"]), (x,), {"kw": {"cache": cache}})
    else:
        out = Runner()(appending_block, (x,), {"cache": cache})
    assert len(cache.keys) == 1
    cache.slot = None  # read back by the caller before backward
    out.sum().backward()
    assert len(cache.keys) == 1 and cache.slot is None
    assert torch.equal(x.grad, torch.linspace(-1.0, 1.0, 8).cos())


class Moded:
    """A cache whose mode the caller switches between passes, as GLM-Image's is switched from write to read."""

    def __init__(self) -> None:
        self.mode = "write"


def moded_block(x: torch.Tensor, cache: Moded) -> torch.Tensor:
    # the two paths save tensors of the same shapes (sin's input), so torch's checkpoint cannot tell them apart
    return (x * 2).sin() if cache.mode == "write" else (x * 3).sin()


def test_a_recompute_takes_the_path_its_forward_took_though_the_mode_changed_before_backward():
    """Switched before backward, the mode would send the recompute down the other path: same shapes, other values,
    wrong gradients without an error. The recompute runs with the plain values the object held when its forward
    began, and the caller's switch stays."""
    cache = Moded()
    x = torch.linspace(-1.0, 1.0, 8, requires_grad=True)
    out = Runner()(moded_block, (x,), {"cache": cache})
    cache.mode = "read"
    out.sum().backward()
    assert torch.equal(x.grad, 2 * (2 * torch.linspace(-1.0, 1.0, 8)).cos()) and cache.mode == "read"
