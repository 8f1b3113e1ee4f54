"""The one-shot's output memory: views carved from per-stream blocks instead of allocations.

``build_chunk_metadata`` hands out fresh tables every call. Allocating them costs more host time
than everything else it does: on the H200 one ``torch.empty`` on the device took 4.2-4.7 µs and
a tensor view 1.6-3.2 µs (``diag_launch`` records of 2026-12-02), and a call needs the device
tables and a host ``cu_seqlens``. So an ``Arena`` keeps one block per table kind and hands out
consecutive slices of it; a slice is never handed out twice, and a block that runs out is
dropped, not reused: its memory goes back to torch's allocator when the last view of it dies.
Every output stays as fresh as an allocation's: nothing ever writes it but the build that
returned it.

The price is memory kept alive: a live result keeps its blocks (``BLOCK_ENTRIES`` entries each,
a few hundred KiB on the device) from being freed. A batch larger than a block gets blocks of its
own size.

Streams: torch's caching allocator orders a freed block's reuse on the stream it was allocated
on, so each (device, stream) has its own arena, whose blocks are allocated while that stream is
current: the one the fill runs on. A stream being captured into a CUDA graph gets no arena (the
caller allocates, from the graph's pool): a replay rewrites its outputs in place, which memory
that outlives the graph's pool must not see.
"""

from __future__ import annotations

import threading

import torch

# entries per block: 32768 sequences' int64 chunk_offsets (256 KiB), their int32 cu_seqlens and
# the host copy (128 KiB each), and 32768 chunk_indices rows (256 KiB as int32)
BLOCK_ENTRIES = 32768


class Arena:
    """Slices of blocks on one device (``device``: a CUDA index, or -1 for the CPU) for one
    stream and one ``chunk_indices`` dtype. ``take`` is thread-safe. The three per-sequence
    tables (``N + 1`` entries each) share one fill level over blocks of equal length."""

    def __init__(self, device: int, indices_dtype: torch.dtype, block_entries: int = BLOCK_ENTRIES):
        self.device = torch.device("cpu") if device < 0 else torch.device("cuda", device)
        self.indices_dtype = indices_dtype
        self.block_entries = block_entries
        self.blocks_made = 0
        self._lock = threading.Lock()
        self._seq_blocks = self._row_block = None
        self._seq_used = self._row_used = 0
        self._seq_entries = self._row_entries = -1  # no block yet: the first take makes them

    def take(self, num_seqs: int, num_chunks: int):
        """``(chunk_offsets int64 [N+1], cu_seqlens int32 [N+1], chunk_indices [NT, 2])`` on the
        device and ``cu_seqlens_cpu`` int32 ``[N+1]`` on the host, none of them handed out before."""
        seqs, rows = num_seqs + 1, num_chunks
        # every slice starts 16-byte aligned, as the block starts the first build (which compiles
        # the fill) got: Triton specializes output pointers on 16-byte alignment
        seq_span, row_span = (seqs + 3) & ~3, (rows + 1) & ~1
        with self._lock:  # two threads must not get the same slice
            if self._seq_used + seq_span > self._seq_entries:
                self._new_seq_blocks(max(seq_span, self.block_entries))
            if self._row_used + row_span > self._row_entries:
                self._new_row_block(max(row_span, self.block_entries))
            s, r = self._seq_used, self._row_used
            self._seq_used, self._row_used = s + seq_span, r + row_span
            offsets, cu, cu_cpu = self._seq_blocks
            indices = self._row_block
        return offsets[s : s + seqs], cu[s : s + seqs], indices[r : r + rows], cu_cpu[s : s + seqs]

    def blocks(self) -> list[torch.Tensor]:
        """The blocks slices come from now (earlier ones live on in their slices only)."""
        return [*(self._seq_blocks or ()), *([self._row_block] if self._row_block is not None else [])]

    def _new_seq_blocks(self, entries: int) -> None:
        self.blocks_made += 3
        with torch.inference_mode():  # views of inference tensors are cheap (chunkmeta.ring.TABLE_MEMORY)
            self._seq_blocks = (
                torch.empty(entries, dtype=torch.int64, device=self.device),
                torch.empty(entries, dtype=torch.int32, device=self.device),
                torch.empty(entries, dtype=torch.int32),
            )
        self._seq_used, self._seq_entries = 0, entries

    def _new_row_block(self, entries: int) -> None:
        self.blocks_made += 1
        with torch.inference_mode():
            self._row_block = torch.empty((entries, 2), dtype=self.indices_dtype, device=self.device)
        self._row_used, self._row_entries = 0, entries


_ARENAS: dict[tuple, Arena] = {}


def arena(device: int, stream: int, indices_dtype: torch.dtype) -> Arena:
    """The arena of ``device``'s ``stream`` (a raw stream handle; 0 for the CPU) for one
    ``chunk_indices`` dtype."""
    key = (device, stream, indices_dtype)
    found = _ARENAS.get(key)
    if found is None:
        found = _ARENAS.setdefault(key, Arena(device, indices_dtype))
    return found
