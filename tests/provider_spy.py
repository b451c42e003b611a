"""Counts the calls the SDPA provider serves, per overridden aten op.

The Python overrides are counted by wrapping them; the forward's C++ kernel
(csrc/ops/sdpa_flash_override.cpp) serves most SDPA calls without running one,
so its own count (torch.ops.flash_attn._sdpa_flash_served_calls) is added to
that op's."""

import torch

from flash_attn_cuda.integrations import sdpa


class ProviderCalls(dict):
    """name -> calls since the spy started; reads the C++ kernel's count live."""

    def __init__(self):
        super().__init__()
        self._cpp_start = self._cpp_served()

    @staticmethod
    def _cpp_served():
        op = getattr(torch.ops.flash_attn, "_sdpa_flash_served_calls", None)
        return op() if op is not None else 0

    def _count(self, name):
        count = super().get(name, 0)
        if name == sdpa._CPP_KERNEL_OP:
            count += self._cpp_served() - self._cpp_start
        return count

    def get(self, name, default=None):
        count = self._count(name)
        return count if count else default

    def __getitem__(self, name):
        count = self._count(name)
        if not count:
            raise KeyError(name)
        return count


def spy(monkeypatch):
    """Counts calls of each override; must run before the kernels are installed."""
    calls = ProviderCalls()
    for name, fn in list(sdpa._OVERRIDES.items()):

        def counting(*args, _fn=fn, _name=name, **kwargs):
            dict.__setitem__(calls, _name, dict.get(calls, _name, 0) + 1)
            return _fn(*args, **kwargs)

        monkeypatch.setitem(sdpa._OVERRIDES, name, counting)
    return calls
