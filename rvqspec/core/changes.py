"""Weights that change after use, and what was derived from them: one mechanism for the core and the integrations.

A weight changes in one of three ways, and each shows in its own place:
- a new tensor (`load_state_dict(assign=True)`, `.to()`, `p.data = t`): its address, shape or dtype;
- an in-place write through the parameter (`p.copy_(t)`, `p.add_(delta)` under no_grad: `load_state_dict`, a LoRA
  merge): torch bumps its version counter `_version`;
- a write through `.data` (`p.data.copy_(t)`, PEFT's merge `weight.data += delta`): bumps nothing, so only the values
  show it.

`stamp` reads the first two in under a microsecond, so a copy derived from one weight (`Derived`: oneDNN's packed
layout, int8 draft heads) checks it on every use. `Watch` adds the third for a whole set of tensors: their stamps plus
their first values, gathered by one `torch.cat` of views made once; the predictor checks its own weights once per
decode call (`MultiCodeDecoder.refresh`), an integration the upstream weights it copied once per frame step (tens of
microseconds at the 0.6B size, where probing every tensor with an index took 2-3 ms). The values compared are a
tensor's first few elements: a dense write (another checkpoint, a merged low-rank delta) changes them, a write to a
few rows far from the first may not (write those through the parameter, under `torch.no_grad()`).
"""

import threading
from collections.abc import Callable, Iterable
from typing import Generic, TypeVar

import torch
from torch import Tensor, nn

WATCHED_VALUES = 16  # first elements of a tensor that `Watch` compares
T = TypeVar("T")


def stamp(tensor: Tensor) -> tuple:
    """What changes when `tensor` is replaced or written in place: its address, version and shape."""
    try:
        version = tensor._version
    except RuntimeError:  # an inference tensor keeps no version: its in-place writes show in `Watch`'s values only
        version = -1
    return tensor.data_ptr(), version, tensor.shape


def parameters_of(module: nn.Module) -> list[Tensor]:
    """Every parameter under `module` (what `module.parameters()` gives, in another order), walked without its
    generators and de-duplication, which cost several times more on a predictor's ~50 modules."""
    found, stack = [], [module]
    while stack:
        m = stack.pop()
        found += [p for p in m._parameters.values() if p is not None]
        stack += [child for child in m._modules.values() if child is not None]
    return found


class Derived(Generic[T]):
    """A copy derived from one weight (`make(weight)`), made again whenever the weight's `stamp` changes, and on the
    first use after `forget` (a write through `.data`, seen by a `Watch`). The lock lets threads that share a model
    see a copy and its source change together; the source is held so that a new weight cannot reuse its address."""

    def __init__(self, make: Callable[[Tensor], T]):
        self.make = make
        self.lock = threading.Lock()
        self.forget()

    def get(self, weight: Tensor) -> T:
        key = stamp(weight)
        with self.lock:
            if key != self.key:
                self.value, self.key, self.source = self.make(weight.detach()), key, weight.detach()
            return self.value

    def forget(self) -> None:
        self.value, self.key, self.source = None, None, None

    def __reduce__(self):  # copies and pickles start empty and derive on first use
        return type(self), (self.make,)


def first_values(tensor: Tensor) -> Tensor:
    """A view of up to WATCHED_VALUES elements of `tensor`'s first row (no copy: later writes show in it)."""
    t = tensor.detach()
    row = t.reshape(-1) if t.dim() == 0 or t.numel() == 0 else t[(0,) * (t.dim() - 1)]
    return row[:WATCHED_VALUES]


class Watch:
    """Follows a set of tensors: `follow` calls an update when they changed since the previous check (new tensors,
    in-place writes: their stamps; writes through `.data`: their first values, see the module docstring). Copies and
    pickles start empty, as does a Watch made without tensors: their first check calls the update."""

    def __init__(self, tensors: Iterable[Tensor] = ()):
        self.stamps: list[tuple] | None = None
        self.views: dict[torch.device, list[Tensor]] = {}
        self.seen: list[Tensor] = []
        self.lock = threading.Lock()
        tensors = list(tensors)
        if tensors:
            self.look(tensors, [stamp(t) for t in tensors])

    def follow(self, tensors: Iterable[Tensor], update: Callable[[], None]) -> None:
        """Call `update` if `tensors` changed. Threads wait while another updates; an update that raises is called
        again at the next check."""
        tensors = list(tensors)
        stamps = [stamp(t) for t in tensors]
        with self.lock:
            if stamps == self.stamps and all(map(torch.equal, self.values(), self.seen)):
                return
            update()
            self.look(tensors, stamps)

    def look(self, tensors: list[Tensor], stamps: list[tuple]) -> None:
        """Remember `tensors` as they are now."""
        self.stamps, self.views = stamps, {}
        for t in tensors:
            self.views.setdefault(t.device, []).append(first_values(t))
        self.seen = self.values()

    def values(self) -> list[Tensor]:
        """The watched values as bytes, one tensor per device (one read of an accelerator)."""
        return [torch.cat(views).view(torch.uint8) for views in self.views.values()]

    def __reduce__(self):
        return Watch, ()
