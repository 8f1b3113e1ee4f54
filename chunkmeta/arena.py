"""The one-shot's output memory: views carved from per-stream blocks instead of allocations.

``build_chunk_metadata`` hands out fresh tables every call. Allocating them costs more host time
than everything else it does: on the H200 one ``torch.empty`` on the device took 4.2-4.7 µs and
a tensor view 1.6-3.2 µs (``diag_launch`` records of 2026-12-02), and a call needs the device
tables and a host ``cu_seqlens``. So an ``Arena`` keeps a device block and a host block and hands
out consecutive slices of them; a slice is never handed out twice, and a block that runs out is
dropped, not reused: its memory goes back to torch's allocator when the last view of it dies.
Every output stays as fresh as an allocation's: nothing ever writes it but the build that
returned it.

A call's device tables lie in one region of the device block, laid out as the step kernel's FLA
entry writes them (``chunkmeta.tables.one_shot_layout``: ``cu_seqlens``, ``chunk_offsets``, then
``chunk_indices``, sized to the batch), so the one launch takes the region's address. Typed
aliases of each block, made once, turn every table into one slice.

The price is memory kept alive: a live result keeps its blocks (``BLOCK_BYTES`` on the device,
``HOST_ENTRIES`` int32 on the host) from being freed. A batch larger than a block gets blocks of
its own size.

Streams: torch's caching allocator orders a freed block's reuse on the stream it was allocated
on, so each (device, stream) has its own arena, whose blocks are allocated while that stream is
current: the one the fill runs on. A stream being captured into a CUDA graph gets no arena (the
caller allocates, from the graph's pool): a replay rewrites its outputs in place, which memory
that outlives the graph's pool must not see.
"""

from __future__ import annotations

import threading

import torch

BLOCK_BYTES = 1 << 20  # device bytes per block: 1024 sequences' header and ~126k int32 rows
HOST_ENTRIES = 32768  # host cu_seqlens entries per block (128 KiB)
_ALIGN = 16  # every region starts 16-byte aligned, as the block the first build (which compiles the fill) got


class _DeviceBlock:
    """One device block and its typed aliases (a table is then one slice)."""

    __slots__ = ("bytes", "i32", "i64", "pairs32", "pairs64", "size", "used")

    def __init__(self, device: torch.device, nbytes: int):
        with torch.inference_mode():  # views of inference tensors are cheap (chunkmeta.ring.TABLE_MEMORY)
            self.bytes = torch.empty(nbytes, dtype=torch.uint8, device=device)
            self.i32 = self.bytes.view(torch.int32)
            self.i64 = self.bytes.view(torch.int64)
            self.pairs32 = self.i32.view(-1, 2)
            self.pairs64 = self.i64.view(-1, 2)
        self.size = nbytes
        self.used = 0


class Arena:
    """Slices of blocks on one device (``device``: a CUDA index, or -1 for the CPU) for one
    stream. ``take`` is thread-safe."""

    def __init__(self, device: int, block_bytes: int = BLOCK_BYTES, host_entries: int = HOST_ENTRIES):
        self.device = torch.device("cpu") if device < 0 else torch.device("cuda", device)
        self.block_bytes = block_bytes
        self.host_entries = host_entries
        self.blocks_made = 0
        self._lock = threading.Lock()
        self._block: _DeviceBlock | None = None
        self._host: torch.Tensor | None = None
        self._host_used = self._host_size = 0

    def take(self, num_seqs: int, num_chunks: int, offsets_at: int, indices_at: int, indices64: bool, region=False):
        """``(chunk_offsets int64 [N+1], cu_seqlens int32 [N+1], chunk_indices [NT, 2])`` on the
        device, in one region laid out with ``chunk_offsets`` at byte ``offsets_at`` and
        ``chunk_indices`` (int64 with ``indices64``) at ``indices_at`` from ``cu_seqlens``, and
        ``cu_seqlens_cpu`` int32 ``[N+1]`` on the host, none of them handed out before; with
        ``region``, the region's bytes too (what a Python launch passes).

        The one-shot's C build calls this every build: its four slices are most of its host time,
        so the rest is kept to shifts and slot reads (issue 33's A/B on an H100 measured the
        one-shot 0.9 us slower than the old arena's, gpu_ab records)."""
        seqs = num_seqs + 1
        span = (indices_at + num_chunks * (16 if indices64 else 8) + _ALIGN - 1) & -_ALIGN
        host_span = (seqs + 3) & ~3
        with self._lock:  # two threads must not get the same slice
            block = self._block
            if block is None or block.used + span > block.size:
                block = self._new_block(max(span, self.block_bytes))
            h = self._host_used
            if h + host_span > self._host_size:
                self._new_host(max(host_span, self.host_entries))
                h = 0
            at = block.used
            block.used = at + span
            self._host_used = h + host_span
            host = self._host
        # at is 16-byte aligned, offsets_at 8-byte and indices_at 16-byte (tables.one_shot_layout)
        o, c = (at + offsets_at) >> 3, at >> 2
        if indices64:
            i = (at + indices_at) >> 4
            indices = block.pairs64[i : i + num_chunks]
        else:
            i = (at + indices_at) >> 3
            indices = block.pairs32[i : i + num_chunks]
        made = block.i64[o : o + seqs], block.i32[c : c + seqs], indices, host[h : h + seqs]
        return (*made, block.bytes[at : at + span]) if region else made

    def blocks(self) -> list[torch.Tensor]:
        """The blocks slices come from now (earlier ones live on in their slices only)."""
        return [b for b in (self._block and self._block.bytes, self._host) if b is not None]

    def _new_block(self, nbytes: int) -> _DeviceBlock:
        self.blocks_made += 1
        self._block = _DeviceBlock(self.device, nbytes)
        return self._block

    def _new_host(self, entries: int) -> None:
        self.blocks_made += 1
        with torch.inference_mode():
            self._host = torch.empty(entries, dtype=torch.int32)
        self._host_used, self._host_size = 0, entries


_ARENAS: dict[tuple, Arena] = {}


def arena(device: int, stream: int) -> Arena:
    """The arena of ``device``'s ``stream`` (a raw stream handle; 0 for the CPU)."""
    key = (device, stream)
    found = _ARENAS.get(key)
    if found is None:
        found = _ARENAS.setdefault(key, Arena(device))
    return found
