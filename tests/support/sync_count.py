"""Counting the reads of tensor data back to the host that a CUDA run would sync on, on any device.

On CPU there is no sync to see, so ``SyncCounter`` counts the idioms that sync on CUDA
(``../shared/census/sglang-0.5.23.md`` §0) where torch dispatches them: ``_local_scalar_dense``
(``.item()``, ``int(t)``, ``bool(t)``, a 0-d tensor as a slice bound or as a Python-scalar argument
such as ``clamp``'s, ``arange(t)``), ``nonzero``, boolean-mask indexing, ``masked_select`` and
``repeat_interleave`` without ``output_size``; and the Python-level ``Tensor.tolist()`` /
``Tensor.cpu()`` calls (a copy to the host, which torch does not dispatch on a CPU tensor). On CUDA,
``torch.cuda.set_sync_debug_mode`` is the check (``checks.no_sync``); this is the CPU stand-in.
"""

from __future__ import annotations

import collections

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
_SCALAR_READS = {aten._local_scalar_dense.default, aten.is_nonzero.default}
_SIZE_READS = {aten.nonzero.default, aten.masked_select.default, aten.nonzero_static.default}


def _is_sync(func, args, kwargs) -> bool:
    if func in _SCALAR_READS or func in _SIZE_READS:
        return True
    if func.overloadpacket is aten.repeat_interleave:
        return kwargs.get("output_size") is None and (len(args) < 4 or args[3] is None)
    if func is aten.index.Tensor:
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1])
    return False


class SyncCounter(TorchDispatchMode):
    """``with SyncCounter() as syncs: ...``; then ``syncs.count`` and ``syncs.by_op``."""

    def __init__(self):
        super().__init__()
        self.by_op: collections.Counter = collections.Counter()
        self._saved = {}

    @property
    def count(self) -> int:
        return sum(self.by_op.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _is_sync(func, args, kwargs):
            self.by_op[str(func.overloadpacket.__name__)] += 1
        return func(*args, **kwargs)

    def _wrap(self, name):
        original = getattr(torch.Tensor, name)
        counter = self.by_op

        def method(tensor, *args, **kwargs):
            counter[name] += 1
            return original(tensor, *args, **kwargs)

        self._saved[name] = original
        setattr(torch.Tensor, name, method)

    def __enter__(self):
        for name in ("tolist", "cpu"):
            self._wrap(name)
        return super().__enter__()

    def __exit__(self, *exc):
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)
        self._saved.clear()
        return super().__exit__(*exc)
