"""The device fill as one Triton kernel, beside its launcher.

It writes one step's ``cu_seqlens``, ``chunk_indices`` and ``chunk_offsets`` into buffers the
caller owns, from the device ``query_start_loc`` and host sizes only: it never reads device
memory on the host (no sync) and copies no metadata arrays host->device.

Importing this module imports triton, so the builder imports it only when the triton backend is
used: that lets a CPU process set ``TRITON_INTERPRET=1`` as late as its first triton build.
"""

from __future__ import annotations

import contextlib
import os

import torch
import triton
import triton.language as tl

from chunkmeta.plan import next_pow2


@triton.jit(
    do_not_specialize=["first_seq", "num_seqs", "num_rows", "seqs_out", "pad_seq"],
    do_not_specialize_on_alignment=["query_start_loc", "step_params"],
)
def chunk_metadata_kernel(
    query_start_loc,  # *i32|*i64 [R+1], device
    step_params,  # *i32 [2] = (first_seq, num_seqs); read only when PARAMS_ON_DEVICE
    cu_seqlens,  # *i32 [>= seqs_out+1]; entry 0 is never written (always 0)
    chunk_indices,  # *i32 [>= num_rows, 2], 8-byte aligned (rows are stored as int64 pairs)
    chunk_offsets,  # *i64 (or *i32: the builder's offsets_dtype) [>= seqs_out+1]; entry 0 is never written
    first_seq,
    num_seqs,
    num_rows,  # rows to write: NT (exact layout) or the row capacity (padded layout)
    seqs_out,  # sequences to write: N (exact) or the padded sequence count (padded)
    pad_seq,  # sequence index of padding rows (padded layout only)
    CHUNK_SHIFT: tl.constexpr,
    BLOCK_SEQS: tl.constexpr,
    SCAN_COLS: tl.constexpr,
    LOG2_SCAN_COLS: tl.constexpr,
    LOG2_BLOCK_SEQS: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    ROW_GROUPS: tl.constexpr,
    PADDED: tl.constexpr,
    PAD_CHUNK: tl.constexpr,
    PARAMS_ON_DEVICE: tl.constexpr,
    ROW_SEARCH: tl.constexpr,
    WRITE_FIRST: tl.constexpr,
    INDICES_64: tl.constexpr,
):
    """Chunk metadata of ``query_start_loc[first_seq : first_seq + num_seqs + 1]``.

    Grid: ``(cdiv(num_rows, BLOCK_ROWS),)``, at least 1. Program ``p`` owns chunk rows
    ``[p * BLOCK_ROWS, (p + 1) * BLOCK_ROWS)`` and the ``p``-th of equal shares of
    ``cu_seqlens[1:]`` and ``chunk_offsets[1:]``.

    Every program scans the per-sequence chunk counts itself (``BLOCK_SEQS >= num_seqs``
    lanes, scanned as a [BLOCK_SEQS / SCAN_COLS, SCAN_COLS] tile) instead of waiting on another
    program, so there is no inter-program dependency. Callers keep
    ``BLOCK_ROWS >= BLOCK_SEQS / 8``, which bounds the redundant scans by the row work: total
    work <= BLOCK_SEQS + 9 * num_rows.

    A row's sequence is the number of sequences whose chunks end at or before it; each row
    finds it by binary lifting over the sorted chunk ends (``find_rows``: LOG2_BLOCK_SEQS
    rounds, the first ones warp-local), then ``t = row - chunk_offsets[seq]``. There is no loop
    over a sequence's chunks: rows are parallel. ROW_GROUPS (the warp count) shapes the rows
    for the warp-local rounds; ROW_SEARCH=False is a diagnostic (wrong rows) that measures the
    kernel without its search.

    Invariants callers rely on: rows are ordered by sequence then chunk with no gaps; a
    zero-length sequence keeps its index and gets no rows; in the padded layout, rows in
    ``[NT, num_rows)`` are ``(pad_seq, PAD_CHUNK)``, sequences in ``(N, seqs_out]`` repeat the last
    offset (zero-length tails). Token counts fit int32 (host-validated); offsets are stored
    as int64.
    """
    if PARAMS_ON_DEVICE:
        first_seq = tl.load(step_params)
        num_seqs = tl.load(step_params + 1)
    fla_tables(
        query_start_loc,
        cu_seqlens,
        chunk_indices,
        chunk_offsets,
        first_seq,
        num_seqs,
        num_rows,
        seqs_out,
        pad_seq,
        tl.program_id(0),
        tl.num_programs(0),
        CHUNK_SHIFT,
        BLOCK_SEQS,
        SCAN_COLS,
        LOG2_SCAN_COLS,
        LOG2_BLOCK_SEQS,
        BLOCK_ROWS,
        ROW_GROUPS,
        PADDED,
        PAD_CHUNK,
        ROW_SEARCH,
        WRITE_FIRST,
        INDICES_64,
    )


@triton.jit
def seq_lanes(BLOCK_SEQS: tl.constexpr, SCAN_COLS: tl.constexpr):
    """The sequence lanes as a [BLOCK_SEQS / SCAN_COLS, SCAN_COLS] tile, scanned along its rows,
    then the row totals down the tile: at thousands of sequences that is faster than one 1-D
    scan (the TritonFill defaults cite the sweep)."""
    return tl.arange(0, BLOCK_SEQS // SCAN_COLS)[:, None] * SCAN_COLS + tl.arange(0, SCAN_COLS)[None, :]


@triton.jit
def scan_counts(seq_chunks):
    """Inclusive prefix sums of the per-lane counts of a ``seq_lanes`` tile: ``(chunk_ends,
    tile_ends, total)``; ``tile_ends`` are the tile rows' last ends (the row search's coarse keys)."""
    tile_chunks = tl.sum(seq_chunks, 1)
    tile_ends = tl.cumsum(tile_chunks, 0)
    chunk_ends = tl.cumsum(seq_chunks, 1) + (tile_ends - tile_chunks)[:, None]
    return chunk_ends, tile_ends, tl.sum(tile_chunks, 0)


@triton.jit
def fla_tables(
    query_start_loc,
    cu_seqlens,
    chunk_indices,
    chunk_offsets,
    first_seq,
    num_seqs,
    num_rows,
    seqs_out,
    pad_seq,
    pid,
    num_programs,
    CHUNK_SHIFT: tl.constexpr,
    BLOCK_SEQS: tl.constexpr,
    SCAN_COLS: tl.constexpr,
    LOG2_SCAN_COLS: tl.constexpr,
    LOG2_BLOCK_SEQS: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    ROW_GROUPS: tl.constexpr,
    PADDED: tl.constexpr,
    PAD_CHUNK: tl.constexpr,
    ROW_SEARCH: tl.constexpr,
    WRITE_FIRST: tl.constexpr,
    INDICES_64: tl.constexpr,
):
    """Program ``pid`` of ``num_programs``' share of FLA's three tables (``chunk_metadata_kernel``
    states the contract; ``chunkmeta.fill.step_fill`` runs it as one entry of a step's launch)."""
    seqs = seq_lanes(BLOCK_SEQS, SCAN_COLS)
    real_seq = seqs < num_seqs
    qsl = query_start_loc + first_seq
    base = tl.load(qsl)
    ends = tl.load(qsl + 1 + seqs, mask=real_seq, other=0)
    starts = tl.load(qsl + seqs, mask=real_seq, other=0)
    seq_chunks = ((ends - starts + ((1 << CHUNK_SHIFT) - 1)) >> CHUNK_SHIFT).to(tl.int32)
    # chunk_offsets[i + 1]
    chunk_ends, tile_ends, num_chunks = scan_counts(seq_chunks)

    # cu_seqlens[1:] and chunk_offsets[1:]: each program stores its share of the sequences
    # (every program has them all), so no program carries all N stores: at thousands of
    # sequences that was faster than program 0 storing them all (bench/RESULTS.md, kernel sweeps)
    share = (seqs_out + num_programs - 1) // num_programs
    mine = (seqs >= pid * share) & (seqs < pid * share + share) & (seqs < seqs_out)
    seq_ends = ends - base
    offset_ends = chunk_ends
    # the exact layout has seqs_out == num_seqs: no tail, so no NT (its reduction costs three
    # barriers, and the compiler drops it when nothing here uses it)
    if PADDED:  # tail sequences repeat (T, NT); the last entry may lie past the BLOCK_SEQS lanes
        num_tokens = tl.load(qsl + num_seqs) - base
        seq_ends = tl.where(real_seq, seq_ends, num_tokens)
        offset_ends = tl.where(real_seq, offset_ends, num_chunks)
        if pid == 0:
            tl.store(cu_seqlens + seqs_out, num_tokens.to(tl.int32))
            tl.store(chunk_offsets + seqs_out, num_chunks.to(tl.int64))
    tl.store(cu_seqlens + 1 + seqs, seq_ends.to(tl.int32), mask=mine)
    tl.store(chunk_offsets + 1 + seqs, offset_ends.to(tl.int64), mask=mine)
    if WRITE_FIRST:  # fresh (uninitialized) outputs: the one-shot allocates without a memset launch
        if pid == 0:
            tl.store(cu_seqlens, 0)
            tl.store(chunk_offsets, 0)

    keys = tl.reshape(tl.where(real_seq, chunk_ends, 2147483647), [BLOCK_SEQS])
    if ROW_SEARCH:
        rows, seq, seq_start = find_rows(
            keys, tile_ends, pid * BLOCK_ROWS, BLOCK_ROWS, ROW_GROUPS, LOG2_BLOCK_SEQS - LOG2_SCAN_COLS, LOG2_SCAN_COLS
        )
    else:  # a diagnostic (bench/kernel_sweep.py): the kernel's cost without its search
        rows = pid * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        seq = tl.min(keys, 0) + tl.zeros_like(rows)
        seq_start = tl.zeros_like(rows)
    chunk = rows - seq_start
    if PADDED:
        real_row = rows < num_chunks
        seq = tl.where(real_row, seq, pad_seq)
        chunk = tl.where(real_row, chunk, PAD_CHUNK)
    if INDICES_64:  # int64 [num_rows, 2] (the ROCm Kimi-K3 helper's dtype for int64 cu_seqlens)
        wide = chunk_indices.to(tl.pointer_type(tl.int64)) + 2 * rows
        tl.store(wide, seq.to(tl.int64), mask=rows < num_rows)
        tl.store(wide + 1, chunk.to(tl.int64), mask=rows < num_rows)
    else:
        store_pairs(chunk_indices, rows, seq, chunk, num_rows)


@triton.jit
def store_pairs(table, rows, first, second, num_rows):
    """Rows of an int32 ``[num_rows, 2]`` table (8-byte aligned): one 8-byte store per row
    (``first`` in the low word, ``second`` in the high word: little-endian int32 pairs),
    coalesced across the warp, instead of two strided 4-byte stores."""
    row = (first.to(tl.int64) & 0xFFFFFFFF) | (second.to(tl.int64) << 32)
    tl.store(table.to(tl.pointer_type(tl.int64)) + rows, row, mask=rows < num_rows)


@triton.jit
def _lift(source, pos, found, rows, span: tl.constexpr, rounds: tl.constexpr, axis: tl.constexpr):
    """``rounds`` rounds of binary lifting over the sorted ``source`` from positions ``pos``:
    move ``pos`` up by span/2, span/4, ... wherever that entry is still at or before the row,
    and keep the last such entry in ``found``."""
    for k in tl.static_range(rounds):
        step = span >> (k + 1)
        probe = tl.gather(source, pos + (step - 1), axis)
        below = probe <= rows
        pos = tl.where(below, pos + step, pos)
        found = tl.where(below, probe, found)
    return pos, found


@triton.jit
def find_rows(
    keys,
    tile_ends,
    first_row,
    BLOCK_ROWS: tl.constexpr,
    ROW_GROUPS: tl.constexpr,
    LOG2_TILES: tl.constexpr,
    LOG2_COLS: tl.constexpr,
):
    """Rows ``first_row + [0, BLOCK_ROWS)`` with the sequence of each and that sequence's first
    row: binary lifting over the sorted chunk ends ``keys`` [TILES * COLS], in three phases of
    decreasing grain.

    Triton stages the source of every ``tl.gather`` through shared memory again (a store per
    element and two barriers per gather), unless the gather is warp-local. So the first rounds
    search at most 64 coarse ends with the rows as [groups, cols], one copy of the coarse ends
    per group, which lets Triton keep each group in one warp: shuffles, no shared memory
    (ROW_GROUPS is the warp count; cols never exceeds the coarse ends, a shape Triton 3.6
    cannot make warp-local). The next rounds search each scan tile row's last end
    ``tile_ends`` [TILES] (= keys[COLS - 1 :: COLS]), the last ones the keys themselves. A
    row's sequence starts at the last entry found at or before it, so no final gather."""
    LOG2_COARSE: tl.constexpr = min(LOG2_TILES, 6)
    coarse: tl.constexpr = 1 << LOG2_COARSE
    per_coarse: tl.constexpr = (1 << LOG2_TILES) >> LOG2_COARSE
    cols: tl.constexpr = min(BLOCK_ROWS // ROW_GROUPS, coarse)
    groups: tl.constexpr = BLOCK_ROWS // cols
    rows = first_row + tl.arange(0, groups)[:, None] * cols + tl.arange(0, cols)[None, :]
    coarse_ends = tl.max(tl.reshape(tile_ends, [coarse, per_coarse]), 1)
    found = tl.zeros(rows.shape, dtype=tl.int32)
    pos, found = _lift(
        tl.broadcast_to(coarse_ends[None, :], [groups, coarse]), found, found, rows, coarse, LOG2_COARSE, 1
    )
    rows = tl.reshape(rows, [BLOCK_ROWS])
    found = tl.reshape(found, [BLOCK_ROWS])
    tile = tl.reshape(pos * per_coarse, [BLOCK_ROWS])
    tile, found = _lift(tile_ends, tile, found, rows, per_coarse, LOG2_TILES - LOG2_COARSE, 0)
    seq, found = _lift(keys, tile << LOG2_COLS, found, rows, 1 << LOG2_COLS, LOG2_COLS, 0)
    return rows, seq, found


def _fast_launch_enabled() -> bool:
    """The direct launcher path: on unless disabled, or unless a launch hook (a profiler such as
    Triton's proton) is installed, since the direct path skips the hooks."""
    if os.environ.get("CHUNKMETA_FAST_LAUNCH", "1") == "0" or os.environ.get("TRITON_INTERPRET"):
        return False
    knobs = getattr(triton, "knobs", None)
    if knobs is None:  # Triton < 3.4 keeps the hook on CompiledKernel
        return getattr(triton.compiler.CompiledKernel, "launch_enter_hook", None) is None
    hook = knobs.runtime.launch_enter_hook
    # Triton 3.6 wraps hooks in a HookChain, empty unless something registered one.
    return hook is None or (hasattr(hook, "calls") and not hook.calls)


class TritonFill:
    """Launches ``chunk_metadata_kernel`` for one fixed set of compile-time constants.

    A builder owns one per layout: its constants come from its capacity, so the kernel compiles
    once per builder shape and ``query_start_loc`` dtype (the pointer type is part of the
    compiled signature), never per step.

    ``__call__`` launches through Triton's JIT with tensors (the first launch per dtype
    compiles); it then keeps the compiled kernel, and ``launch`` (CUDA only) calls that kernel's
    launcher directly with plain ints, skipping the JIT's per-call argument binding and cache
    lookup (tens of microseconds of host time). Every scalar argument is excluded from
    specialization, so one compiled kernel is valid for all values. ``CHUNKMETA_FAST_LAUNCH=0``
    keeps the JIT path. ``plain_kernel`` hands the compiled kernel to ``chunkmeta.native``,
    whose C build launches it with no Python in between.
    """

    def __init__(
        self,
        *,
        chunk_size: int,
        block_seqs: int,
        padded: bool,
        params_on_device: bool,
        pad_chunk: int = 0,
        block_rows: int | None = None,
        num_warps: int | None = None,
        scan_cols: int | None = None,
        row_search: bool = True,
        write_first: bool = False,
        indices_dtype: torch.dtype = torch.int32,
    ):
        self.block_seqs = next_pow2(max(block_seqs, 2))
        # The defaults are the fastest or tied shapes of the H200 kernel sweeps (bench/RESULTS.md,
        # kernel_sweep records): 256-row programs up to 512 sequences, 512-row ones from 1024;
        # 4 warps up to 256 sequences, 8 up to 2048, 16 above; scan tile rows 4 wide from 1024
        # sequences, 16 wide below. block_seqs / 8 keeps the redundant per-program scans
        # within 8x the row work.
        self.block_rows = block_rows or max(256 if self.block_seqs <= 512 else 512, self.block_seqs // 8)
        self.num_warps = num_warps or (4 if self.block_seqs <= 256 else 8 if self.block_seqs <= 2048 else 16)
        scan_cols = min(scan_cols or (4 if self.block_seqs >= 1024 else 16), self.block_seqs)
        self.constexprs = dict(
            CHUNK_SHIFT=chunk_size.bit_length() - 1,
            BLOCK_SEQS=self.block_seqs,
            SCAN_COLS=scan_cols,
            LOG2_SCAN_COLS=scan_cols.bit_length() - 1,
            LOG2_BLOCK_SEQS=self.block_seqs.bit_length() - 1,
            BLOCK_ROWS=self.block_rows,
            ROW_GROUPS=min(self.num_warps, self.block_rows),
            PADDED=padded,
            PAD_CHUNK=pad_chunk,  # padding rows' chunk (chunkmeta.layout); 0 unless "past_end"
            PARAMS_ON_DEVICE=params_on_device,
            ROW_SEARCH=row_search,  # False: bench/kernel_sweep.py's diagnostic (wrong rows)
            WRITE_FIRST=write_first,  # entry 0 of cu_seqlens / chunk_offsets too (fresh outputs)
            INDICES_64=indices_dtype == torch.int64,
        )
        self._constexpr_values = tuple(self.constexprs.values())
        self._device_index = -1
        self._kernels = {}  # query_start_loc dtype -> compiled kernel
        self._launchers = {}  # query_start_loc dtype -> (callable, function, fixed leading arguments)

    def launch(
        self,
        dtype: torch.dtype,
        query_start_loc: int,
        params: int,
        cu_seqlens: int,
        chunk_indices: int,
        chunk_offsets: int,
        first_seq: int,
        num_seqs: int,
        num_rows: int,
        seqs_out: int,
        pad_seq: int,
    ) -> bool:
        """Fast launch with data pointers as ints; False (nothing launched) if not available."""
        launcher = self._launchers.get(dtype)
        if launcher is None or torch._C._cuda_getDevice() != self._device_index:
            return False
        call, function, fixed = launcher
        call(
            -(-num_rows // self.block_rows) or 1,
            1,
            1,
            torch._C._cuda_getCurrentRawStream(self._device_index),
            function,
            *fixed,
            query_start_loc,
            params,
            cu_seqlens,
            chunk_indices,
            chunk_offsets,
            first_seq,
            num_seqs,
            num_rows,
            seqs_out,
            pad_seq,
            *self._constexpr_values,
        )
        return True

    def __call__(
        self,
        query_start_loc: torch.Tensor,
        params: torch.Tensor,
        cu_seqlens: torch.Tensor,
        chunk_indices: torch.Tensor,
        chunk_offsets: torch.Tensor,
        first_seq: int,
        num_seqs: int,
        num_rows: int,
        seqs_out: int,
        pad_seq: int = 0,
    ) -> None:
        """Launch through the JIT with tensors (works everywhere, including the interpreter), on
        the current stream of the tensors' device whichever device is current."""
        if self.launch(
            query_start_loc.dtype,
            query_start_loc.data_ptr(),
            params.data_ptr(),
            cu_seqlens.data_ptr(),
            chunk_indices.data_ptr(),
            chunk_offsets.data_ptr(),
            first_seq,
            num_seqs,
            num_rows,
            seqs_out,
            pad_seq,
        ):
            return
        grid = (-(-num_rows // self.block_rows) or 1,)
        # Triton launches on the current device: with another one current (a runner's helper
        # thread, a tensor-parallel process touching a peer) the kernel would run in the wrong
        # context, on pointers of another device.
        device = query_start_loc.device
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            kernel = chunk_metadata_kernel[grid](
                query_start_loc,
                params,
                cu_seqlens,
                chunk_indices,
                chunk_offsets,
                first_seq,
                num_seqs,
                num_rows,
                seqs_out,
                pad_seq,
                num_warps=self.num_warps,
                **self.constexprs,
            )
        dtype = query_start_loc.dtype
        if dtype not in self._kernels and query_start_loc.is_cuda and _fast_launch_enabled():
            self._kernels[dtype] = kernel
            launcher = _direct_launcher(kernel)
            if launcher is not None:
                self._launchers[dtype] = launcher
            self._device_index = query_start_loc.device.index

    def plain_kernel(self, dtype: torch.dtype):
        """``(function handle, num_warps, shared bytes)`` of the compiled kernel for ``dtype`` when
        a plain ``cuLaunchKernel`` launches it as Triton would (``plain_launch``); else None."""
        return plain_launch(self._kernels.get(dtype))


def plain_launch(kernel):
    """``(function handle, num_warps, shared bytes)`` of a compiled Triton kernel when a plain
    ``cuLaunchKernel`` launches it as Triton would (one CTA per program, no cooperative/PDL
    launch, no scratch buffers); else None."""
    if kernel is None:
        return None
    meta = kernel.metadata
    plain = (
        getattr(meta, "num_ctas", 1) == 1
        and not getattr(meta, "launch_cooperative_grid", False)
        and not getattr(meta, "launch_pdl", False)
        and getattr(meta, "global_scratch_size", 0) == 0
        and getattr(meta, "profile_scratch_size", 0) == 0
        and _needs_no_scratch(getattr(kernel, "run", None))
        and getattr(kernel, "function", None)
    )
    return (kernel.function, meta.num_warps, meta.shared) if plain else None


def _needs_no_scratch(run) -> bool:
    """Whether Triton's launcher for a kernel allocates no scratch buffers (an unknown launcher,
    without the attributes, counts as needing them)."""
    return getattr(run, "global_scratch_size", 1) == 0 and getattr(run, "profile_scratch_size", 1) == 0


def _direct_launcher(kernel):
    """How to launch a compiled kernel without the JIT: ``(callable, function, fixed args)``.

    The compiled kernel's ``run(grid0, grid1, grid2, stream, function, packed_metadata,
    launch_metadata, enter_hook, exit_hook, *args)`` is Triton's own launch entry (3.3 and
    later). On Triton 3.6's ``CudaLauncher`` that Python wrapper only adds the cooperative/PDL
    flags and two scratch buffers before calling its C ``launch``; when the kernel uses no
    scratch, calling ``launch`` directly saves microseconds per build. Any other launcher
    shape keeps ``run``. None when the kernel lacks what either needs.
    """
    import inspect

    run = getattr(kernel, "run", None)
    packed = getattr(kernel, "packed_metadata", None)
    if run is None or packed is None:
        return None
    launch = getattr(run, "launch", None)
    try:
        wrapper = list(inspect.signature(type(run).__call__).parameters)
    except (TypeError, ValueError):
        wrapper = []
    if (
        launch is not None
        and wrapper == ["self", "gridX", "gridY", "gridZ", "stream", "function", "args"]
        and _needs_no_scratch(run)
    ):
        fixed = (run.launch_cooperative_grid, run.launch_pdl, None, None, packed, None, None, None)
        return launch, kernel.function, fixed
    return run, kernel.function, (packed, None, None, None)
