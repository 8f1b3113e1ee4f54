"""The test oracle: FLA's chunk metadata contract, written as plainly as possible.

Lists in, lists out, loops only. Nothing here is fast and nothing here is clever; every other
implementation is checked against it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple


class Reference(NamedTuple):
    cu_seqlens: list[int]
    chunk_indices: list[tuple[int, int]]
    chunk_offsets: list[int]
    num_seqs: int
    num_tokens: int
    num_chunks: int
    max_seqlen: int


def chunk_metadata(
    query_start_loc: Sequence[int], chunk_size: int, first_seq: int = 0, num_seqs: int | None = None
) -> Reference:
    """FLA's (>= 0.5.1) cu_seqlens / chunk_indices / chunk_offsets for one prefill slice."""
    query_start_loc = [int(v) for v in query_start_loc]
    if num_seqs is None:
        num_seqs = len(query_start_loc) - 1 - first_seq
    start = query_start_loc[first_seq]
    cu_seqlens = [query_start_loc[first_seq + i] - start for i in range(num_seqs + 1)]

    chunk_indices = []
    chunk_offsets = [0]
    for i in range(num_seqs):
        length = cu_seqlens[i + 1] - cu_seqlens[i]
        num_chunks = (length + chunk_size - 1) // chunk_size
        for t in range(num_chunks):
            chunk_indices.append((i, t))
        chunk_offsets.append(chunk_offsets[-1] + num_chunks)

    lengths = [cu_seqlens[i + 1] - cu_seqlens[i] for i in range(num_seqs)]
    return Reference(
        cu_seqlens=cu_seqlens,
        chunk_indices=chunk_indices,
        chunk_offsets=chunk_offsets,
        num_seqs=num_seqs,
        num_tokens=cu_seqlens[-1],
        num_chunks=len(chunk_indices),
        max_seqlen=max(lengths, default=0),
    )


def padded_chunk_metadata(
    query_start_loc: Sequence[int],
    chunk_size: int,
    padded_num_seqs: int,
    padded_num_rows: int,
    pad_seq: int,
    first_seq: int = 0,
    num_seqs: int | None = None,
    pad_chunk: int = 0,
) -> Reference:
    """The padded layouts (CUDA graphs, and bounded rows): the exact metadata, then zero-length
    tail sequences up to ``padded_num_seqs`` and padding rows ``(pad_seq, pad_chunk)`` up to
    ``padded_num_rows``."""
    exact = chunk_metadata(query_start_loc, chunk_size, first_seq, num_seqs)
    tail = padded_num_seqs - exact.num_seqs
    rows = padded_num_rows - exact.num_chunks
    return exact._replace(
        cu_seqlens=exact.cu_seqlens + [exact.num_tokens] * tail,
        chunk_indices=exact.chunk_indices + [(pad_seq, pad_chunk)] * rows,
        chunk_offsets=exact.chunk_offsets + [exact.num_chunks] * tail,
    )


# --- causal-conv1d block tables (vLLM's contract) --------------------------------------------

CONV_BLOCK_M = 8  # tokens per conv program: vLLM fixes BLOCK_M at 8
PAD_SLOT_ID = -1  # vLLM's pad value for the tails of the conv tables


class ConvReference(NamedTuple):
    nums: list[int]
    tot: int
    batch_ptr: list[int]
    token_chunk_offset_ptr: list[int]
    padded_batch_ptr: list[int]
    padded_token_chunk_offset_ptr: list[int]


def causal_conv1d_metadata(query_start_loc: Sequence[int], block_m: int = CONV_BLOCK_M) -> ConvReference:
    """vLLM's causal-conv1d block tables over the rows the conv kernel receives.

    ``query_start_loc`` is the one the kernel is given (vLLM: the non-spec rows, decodes and
    padding rows included; Mamba: the prefill rows), not rebased. Row ``i`` of length ``len_i``
    gets ``nums[i] = cdiv(len_i, block_m)`` blocks; a zero-length row gets none but keeps its
    index. The pairs ``(batch_ptr[k], token_chunk_offset_ptr[k])`` for ``k < tot`` are
    ``(i, b)`` for every row ``i`` and block ``b < nums[i]``, ordered by row then block;
    ``tot = sum(nums)`` is the host count the kernel's grid is sized by. vLLM allocates both
    tables with ``2 * max(1024, tot)`` entries and fills the tail with ``PAD_SLOT_ID``; the kernel
    reads only ``[0:tot]``.
    """
    query_start_loc = [int(v) for v in query_start_loc]
    nums = []
    batch_ptr = []
    token_chunk_offset_ptr = []
    for i in range(len(query_start_loc) - 1):
        length = query_start_loc[i + 1] - query_start_loc[i]
        blocks = (length + block_m - 1) // block_m
        nums.append(blocks)
        for b in range(blocks):
            batch_ptr.append(i)
            token_chunk_offset_ptr.append(b)
    tot = len(batch_ptr)
    tail = [PAD_SLOT_ID] * (2 * max(1024, tot) - tot)
    return ConvReference(
        nums=nums,
        tot=tot,
        batch_ptr=batch_ptr,
        token_chunk_offset_ptr=token_chunk_offset_ptr,
        padded_batch_ptr=batch_ptr + tail,
        padded_token_chunk_offset_ptr=token_chunk_offset_ptr + tail,
    )


def sglang_conv_block_table(seq_lens: Sequence[int], block_m: int = CONV_BLOCK_M) -> list[tuple[int, int]] | None:
    """SGLang's GDN conv block table (int32 ``[tot, 2]``), or None where SGLang launches the
    rectangular grid instead.

    The same ``(row, block)`` pairs as vLLM's tables, as rows of one table. SGLang builds it only
    for a ragged batch: some rows, and ``N * max(nums) > 4 * sum(nums)`` (most of the rectangular
    ``N x max(nums)`` grid would be empty).
    """
    nums = [(int(n) + block_m - 1) // block_m for n in seq_lens]
    if not nums or len(nums) * max(nums) <= 4 * sum(nums):
        return None
    return [(i, b) for i in range(len(nums)) for b in range(nums[i])]


# --- Mamba2 SSD chunk tables, vLLM's convention (physical chunks on absolute positions) -------


class Mamba2Reference(NamedTuple):
    cu_chunk_seqlens: list[int]
    seq_idx: list[int]
    last_chunk_indices: list[int]
    checkpoint_chunk_idx: list[int] | None
    num_chunks: int
    has_initial_states: list[bool]
    prep_initial_states: bool


def _segment_chunks(start: int, num_tokens: int, chunk_size: int) -> list[int]:
    """Lengths of the chunks a segment of ``num_tokens`` tokens starting at absolute position
    ``start`` is cut into: a chunk ends at every multiple of ``chunk_size`` inside the segment and
    at its end. An empty segment that starts mid-chunk still gets one empty chunk (vLLM finishes
    the partial chunk with ``min(room, 0)`` tokens); one that starts on a boundary gets none."""
    end = start + num_tokens
    cuts = [start]
    for boundary in range((start // chunk_size + 1) * chunk_size, end, chunk_size):
        cuts.append(boundary)
    if num_tokens > 0 or start % chunk_size != 0:
        cuts.append(end)
    return [cuts[k + 1] - cuts[k] for k in range(len(cuts) - 1)]


def mamba2_chunk_metadata(
    query_start_loc: Sequence[int],
    num_computed_tokens: Sequence[int],
    chunk_size: int,
    first_seq: int = 0,
    num_seqs: int | None = None,
    checkpoint_offsets: Sequence[int] | None = None,
) -> Mamba2Reference:
    """vLLM's Mamba2 SSD chunk tables for the prefill slice ``[first_seq, first_seq + num_seqs)``.

    Tokens are rebased to the slice's first token. Prefill row ``i`` (``0..num_seqs-1``) brings
    ``len_i`` new tokens after ``num_computed_tokens[i]`` tokens already in the cache, so its
    tokens sit at absolute positions ``[c_i, c_i + len_i)``. Rows are cut in order; a chunk holds
    tokens of one row only and ends on every absolute multiple of ``chunk_size`` (so the first
    chunk of a row with ``c_i % chunk_size != 0`` is partial, and the chunking does not depend on
    how chunked prefill split the request) and at the row's end. ``checkpoint_offsets[i] = k > 0``
    (``0 <= k <= len_i``; 0 = none) adds a chunk end ``k`` tokens into the row: the row is cut as
    two segments, ``[c_i, c_i + k)`` then ``[c_i + k, c_i + len_i)``.

    - ``cu_chunk_seqlens`` ``[num_chunks + 1]``: chunk boundaries, from 0 to the slice's tokens;
    - ``seq_idx`` ``[num_chunks]``: the prefill row of each chunk;
    - ``last_chunk_indices`` ``[num_seqs]``: the index of the last chunk cut so far once row ``i``
      is cut. A zero-length row (or an empty last segment) that starts mid-chunk gets one empty
      chunk of its own; one on a chunk boundary gets none, so its entry repeats the previous
      row's last chunk (``-1`` if there is none yet);
    - ``checkpoint_chunk_idx`` ``[num_seqs]`` (int64 on the device): the chunk that ends on row
      ``i``'s checkpoint, 0 for a row without one; None when no row has a checkpoint;
    - ``has_initial_states[i] = c_i > 0``, ``prep_initial_states = any(has_initial_states)``.
    """
    query_start_loc = [int(v) for v in query_start_loc]
    if num_seqs is None:
        num_seqs = len(query_start_loc) - 1 - first_seq
    if len(num_computed_tokens) != num_seqs:
        raise ValueError(f"num_computed_tokens has {len(num_computed_tokens)} entries for {num_seqs} prefill rows")
    if checkpoint_offsets is not None and len(checkpoint_offsets) != num_seqs:
        raise ValueError(f"checkpoint_offsets has {len(checkpoint_offsets)} entries for {num_seqs} prefill rows")

    cu_chunk_seqlens = [0]
    seq_idx = []
    last_chunk_indices = []
    checkpoint_chunk_idx = [0] * num_seqs
    any_checkpoint = False
    for i in range(num_seqs):
        length = query_start_loc[first_seq + i + 1] - query_start_loc[first_seq + i]
        computed = int(num_computed_tokens[i])
        checkpoint = int(checkpoint_offsets[i]) if checkpoint_offsets is not None else 0
        if computed < 0 or not 0 <= checkpoint <= length:
            raise ValueError(f"row {i}: computed {computed}, checkpoint {checkpoint}, length {length}")
        if checkpoint:
            segments = [(computed, checkpoint), (computed + checkpoint, length - checkpoint)]
        else:
            segments = [(computed, length)]
        for s, (start, num_tokens) in enumerate(segments):
            for chunk_len in _segment_chunks(start, num_tokens, chunk_size):
                seq_idx.append(i)
                cu_chunk_seqlens.append(cu_chunk_seqlens[-1] + chunk_len)
            if s == len(segments) - 1:
                last_chunk_indices.append(len(seq_idx) - 1)
            else:
                checkpoint_chunk_idx[i] = len(seq_idx) - 1
                any_checkpoint = True

    has_initial_states = [int(c) > 0 for c in num_computed_tokens]
    return Mamba2Reference(
        cu_chunk_seqlens=cu_chunk_seqlens,
        seq_idx=seq_idx,
        last_chunk_indices=last_chunk_indices,
        checkpoint_chunk_idx=checkpoint_chunk_idx if any_checkpoint else None,
        num_chunks=len(seq_idx),
        has_initial_states=has_initial_states,
        prep_initial_states=any(has_initial_states),
    )


# --- Mamba2 SSD tables, SGLang's convention (logical chunks of the packed batch) -------------


class SglangMamba2Reference(NamedTuple):
    seq_idx: list[list[int]]
    chunk_indices: list[int] | None
    chunk_offsets: list[int] | None
    has_initial_states: list[bool]
    prep_initial_states: bool
    num_prefills: int
    num_prefill_tokens: int


def sglang_chunk_indices_offsets(query_start_loc: Sequence[int], chunk_size: int) -> tuple[list[int], list[int]]:
    """SGLang's logical chunks (``_query_start_loc_to_chunk_indices_offsets``).

    Physical chunk ``p`` is packed tokens ``[p * chunk_size, (p + 1) * chunk_size)`` of the whole
    batch (not of a row, and not absolute positions). A logical chunk is a run of one row's tokens
    inside one physical chunk: each row, in order, starts one at its first token and one at every
    physical boundary inside it. ``chunk_indices[k]`` is logical chunk ``k``'s physical chunk,
    ``chunk_offsets[k]`` the offset of its first token in it. A zero-length row that starts
    mid-chunk (never row 0) gets one empty logical chunk at its start; one on a boundary gets none.
    Example (SGLang's): ``[0, 5, 10]``, chunk 8 -> indices ``[0, 0, 1]``, offsets ``[0, 5, 0]``.
    """
    query_start_loc = [int(v) for v in query_start_loc]
    chunk_indices = []
    chunk_offsets = []
    for i in range(len(query_start_loc) - 1):
        start = query_start_loc[i]
        for length in _segment_chunks(start, query_start_loc[i + 1] - start, chunk_size):
            chunk_indices.append(start // chunk_size)
            chunk_offsets.append(start % chunk_size)
            start += length
    return chunk_indices, chunk_offsets


def sglang_mamba2_mixed(
    query_start_loc: Sequence[int],
    extend_prefix_lens: Sequence[int],
    chunk_size: int,
    num_prefills: int | None = None,
) -> SglangMamba2Reference:
    """SGLang's ``Mamba2Metadata.prepare_mixed`` tables for an extend (or mixed) batch.

    The extend rows come first: ``num_prefills`` (default: all rows of ``query_start_loc``) of
    the batch's rows. ``has_initial_states[r] = extend_prefix_lens[r] > 0`` for every row of
    ``extend_prefix_lens``; ``prep_initial_states`` is that over the extend rows. ``seq_idx`` is
    ``[1, T]``: the extend row of each of the ``T`` extend tokens. ``chunk_indices`` /
    ``chunk_offsets`` are the logical chunks of the extend rows
    (``sglang_chunk_indices_offsets``) when some extend row has a cached prefix, else None.
    """
    query_start_loc = [int(v) for v in query_start_loc]
    if num_prefills is None:
        num_prefills = len(query_start_loc) - 1
    rows = query_start_loc[: num_prefills + 1]
    has_initial_states = [int(p) > 0 for p in extend_prefix_lens]
    prep_initial_states = any(has_initial_states[:num_prefills])
    seq_idx = []
    for i in range(num_prefills):
        seq_idx.extend([i] * (rows[i + 1] - rows[i]))
    chunk_indices = chunk_offsets = None
    if prep_initial_states:
        chunk_indices, chunk_offsets = sglang_chunk_indices_offsets(rows, chunk_size)
    return SglangMamba2Reference(
        seq_idx=[seq_idx],
        chunk_indices=chunk_indices,
        chunk_offsets=chunk_offsets,
        has_initial_states=has_initial_states,
        prep_initial_states=prep_initial_states,
        num_prefills=num_prefills,
        num_prefill_tokens=rows[num_prefills] - rows[0],
    )
