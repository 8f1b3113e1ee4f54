"""The ring: a builder's persistent buffers, which slot a build writes, and which results are live.

A step builder's tables (``chunkmeta.tables.slot_layout``) live in ``depth`` slots: one byte
arena per slot on the builder's device, every table at a fixed offset, and per slot a host int32
``cu_seqlens_cpu`` buffer for each FLA table (``TableRing``).

The ring rule: build ``k`` (its generation) writes slot ``k % depth`` and returns views of it.
The object returned by build ``k`` keeps its values through builds ``k+1 .. k+depth-1``; build
``k+depth`` reuses its slot and retires it (``is_live`` turns False, ``check_live`` raises).
On one CUDA stream the GPU side is safe at any depth (the next fill is queued after every kernel
already queued that reads the slot); the depth bounds how long the *host* may hold an object
and still queue work that reads it. ``retire(generation)`` retires every build up to it at once
(the service's strict mode). Liveness is host bookkeeping only: it never reads the device.
"""

from __future__ import annotations

import contextlib

import torch

from chunkmeta.plan import round_up
from chunkmeta.results import PAIRS, ROW

VIEW_CACHE_LIMIT = 16384  # entries per view cache (a view is ~1-2 KB of host memory)
# TABLE_MEMORY: every table's memory (these rings' buffers, chunkmeta.arena's blocks) is made in
# torch.inference_mode(), so the tables are inference tensors. A view of one skips autograd's
# view and version tracking: 0.75 against 2.15 us a slice on the development CPU, and builds
# make a view for every new row count. Engines run their steps in inference mode (vLLM's
# execute_model, SGLang's default), where nothing differs; outside it, writing a table in place
# raises (it is immutable anyway) and autograd cannot save one for backward (clone it).
# Writers other than kernels (the torch fill) run in inference mode.
SPOILED = -1  # a slot's generation after a failed fill (no build has it)


class SlotLedger:
    """The ring rule's bookkeeping: which slot a build writes, and which generations are live.

    The ``Lease`` of every object a ring-backed builder returns (``chunkmeta.metadata.Lease``).
    Host only: it never reads the device.
    """

    def __init__(self, depth: int):
        self.depth = depth
        self._slot_generation = [0] * depth
        self._retired_through = 0  # generations <= this were retired explicitly (retire())
        self.generation = 0  # the newest published build's

    # chunkmeta.native's step claims and publishes as these two do, in C: keep them in step
    def claim(self) -> tuple[int, int]:
        """``(slot, generation)`` of the next build; nothing changes until ``publish``."""
        generation = self.generation + 1
        return generation % self.depth, generation

    def publish(self, slot: int, generation: int) -> None:
        """Record a finished build: its slot now holds ``generation``'s tables."""
        self.generation = generation
        self._slot_generation[slot] = generation

    def is_live(self, slot: int, generation: int) -> bool:
        return self._slot_generation[slot] == generation and generation > self._retired_through

    def retire(self, generation: int) -> None:
        self._retired_through = max(self._retired_through, generation)

    @contextlib.contextmanager
    def writing(self, slot: int):
        """Around a fill of ``slot`` (and what follows it before the publish): if it raises, the
        fill may have written part of the slot, so the tables published there are no longer what
        they were and their object stops being live (a live object is never overwritten). The
        slot then holds nothing until a build publishes into it again. (``chunkmeta.native``'s
        step does the same in C.)"""
        try:
            yield
        except BaseException:
            self._slot_generation[slot] = SPOILED
            raise

    def retired_message(self, slot: int, generation: int) -> str:
        if generation <= self._retired_through:
            return (
                f"the metadata of build {generation} is retired: its step ended (the service's strict "
                "mode). Use the open step's metadata (service.current)."
            )
        if self._slot_generation[slot] == SPOILED:
            return (
                f"the metadata of build {generation} is retired: a later build's fill failed while writing "
                f"its ring slot {slot}. Use the current step's metadata."
            )
        return (
            f"the metadata of build {generation} is retired: its ring slot {slot} was rebuilt by build "
            f"{self._slot_generation[slot]} (ring_depth={self.depth}). Use the current step's "
            "metadata, or raise ring_depth if the host must hold more steps."
        )


class TableRing(SlotLedger):
    """``depth`` slots of a step builder's tables (``chunkmeta.tables.slot_layout``): one byte
    arena per slot on the device, every region at its fixed offset (the kernel's compile-time
    constants), so a build passes one pointer per slot; and per slot a host int32 buffer of
    ``host_entries`` for each name in ``host_names`` (the FLA tables' ``cu_seqlens_cpu``).
    Views are cached in ``views`` by ``(slot, region, count, shape)`` (``chunkmeta.results``)."""

    def __init__(
        self, depth: int, regions: dict, slot_bytes: int, device: torch.device, host_names=(), host_entries: int = 0
    ):
        super().__init__(depth)
        # Slot strides stay 16-byte multiples: every slot is as aligned as the first, which a
        # compiled kernel (specialized on its first launch's pointers) relies on.
        # inference tensors: cheap views (TABLE_MEMORY); a dtype view made outside inference
        # mode is a normal tensor again, so the regions are made in it too
        with torch.inference_mode():
            self.arena = torch.zeros(depth, round_up(max(slot_bytes, 16), 16), dtype=torch.uint8, device=device)
            self.host = {name: torch.zeros(depth, host_entries, dtype=torch.int32) for name in host_names}
            self._regions = [
                {
                    region.offset: self.arena[
                        k, region.offset : region.offset + region.entries * region.dtype.itemsize
                    ].view(region.dtype)
                    for fields in regions.values()
                    for region in fields.values()
                }
                for k in range(depth)
            ]
        self._pointers = [self.arena[k].data_ptr() for k in range(depth)]
        self.host_np = {name: t.numpy() for name, t in self.host.items()}
        self.views: dict[tuple, torch.Tensor] = {}
        # fixed from here on: the C executor (chunkmeta.results) takes it once, and clears
        # ``views`` at the same size as make_view
        self.view_limit = VIEW_CACHE_LIMIT
        self._bases: dict[tuple, torch.Tensor] = {}

    def pointer(self, slot: int) -> int:
        return self._pointers[slot]

    def host_pointers(self) -> dict[str, list[int]]:
        """Each host buffer's address per slot."""
        return {name: [t[k].data_ptr() for k in range(self.depth)] for name, t in self.host.items()}

    def region(self, slot: int, offset: int) -> torch.Tensor:
        """The whole region at ``offset`` of a slot (1-D, its dtype)."""
        return self._regions[slot][offset]

    def make_view(self, slot: int, region, count: int, shape: int) -> torch.Tensor:
        """The first ``count`` entries of ``region`` (an arena offset, or a host buffer's name),
        shaped ``[n]``, ``[n, 2]`` (pairs) or ``[1, n]`` (``chunkmeta.results``' shapes), cached."""
        key = (slot, region, count, shape)
        view = self.views.get(key)
        if view is None:
            if len(self.views) >= self.view_limit:
                self.views.clear()
            # one slice per view (two for ROW): most steps make one for each table whose row count is new
            base = self.view_base(slot, region, shape)
            assert 0 <= count <= base.shape[0], (region, count, base.shape)  # a slice would clip, not raise
            view = self.views[key] = base[:count].view(1, count) if shape == ROW else base[:count]
        return view

    def view_base(self, slot: int, region, shape: int) -> torch.Tensor:
        """What ``make_view`` slices a ``count``-entry view of: the region, as pairs for ``PAIRS``."""
        base = self._bases.get((slot, region, shape))
        if base is None:
            assert 0 <= slot < self.depth, slot  # a negative index would read another slot's arena
            base = self.host[region][slot] if isinstance(region, str) else self._regions[slot][region]
            if shape == PAIRS:
                base = base[: base.shape[0] // 2 * 2].view(-1, 2)
            self._bases[(slot, region, shape)] = base
        return base
