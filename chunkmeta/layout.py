"""Table shapes: what one build writes, for every layout a consumer reads.

One build writes ``cu_seqlens[1 : seqs_out + 1]``, ``chunk_offsets[1 : seqs_out + 1]`` and
``chunk_indices[0 : rows_out]`` (entry 0 of the first two is always 0). The real tables come
first: N sequences, NT rows. What follows them is the layout's padding:

``exact``      FLA's layout: ``seqs_out = N``, ``rows_out = NT``, no padding.
``"tail"``     capacity-shaped: zero-length tail sequences up to ``max_num_seqs + 1`` and padding
               rows ``(max_num_seqs, 0)``, which point at the reserved tail sequence: harmless
               to every FLA kernel (GDN included), whose programs find no tokens there.
``"negative"`` capacity-shaped, ``max_num_seqs`` sequences, padding rows ``(-1, 0)``: FLA's KDA
               ``use_graph=True`` contract (its kernels skip negative rows).
``"past_end"`` capacity-shaped, ``max_num_seqs`` sequences, padding rows ``(0, PAST_END_CHUNK)``:
               a chunk past the end of sequence 0, on which every varlen FLA chunk kernel does
               nothing (its ``i_t * BT >= T`` guard). SGLang's convention (its KDA prefill
               graph), used where the consumer keeps the engine's own ``cu_seqlens``.
bounded        no host lengths (``ChunkMetadataBuilder.build_bounded``): ``seqs_out = N``,
               ``rows_out = chunk_row_bound(N, T_max, C)``, an upper bound on NT from host
               sizes alone; the device finds the real NT and pads the rest in ``"past_end"``
               or ``"negative"`` rows.

Padding rows never point at a non-empty sequence: that would corrupt the output.
"""

from __future__ import annotations

from typing import NamedTuple

from chunkmeta.errors import ChunkMetaError

PADS = ("tail", "negative", "past_end")
BOUNDED_PADS = ("past_end", "negative")  # a bounded build has no reserved tail sequence
# A chunk past the end of any sequence of a builder whose max_num_tokens is at most
# PAST_END_CHUNK * chunk_size (the builder checks this before it hands out such rows), so FLA's
# chunk kernels return at once.
PAST_END_CHUNK = 1 << 20


class Layout(NamedTuple):
    """What one build writes: sequences and rows, and the padding rows' ``(seq, chunk)``."""

    seqs_out: int
    rows_out: int
    pad_seq: int
    pad_chunk: int


def exact(num_seqs: int, num_chunks: int) -> Layout:
    return Layout(num_seqs, num_chunks, 0, 0)


def padded_num_seqs(pad: str, max_num_seqs: int) -> int:
    """Sequences in a capacity-shaped ``cu_seqlens`` (which has one more entry)."""
    return max_num_seqs + 1 if pad == "tail" else max_num_seqs


def padding_row(pad: str, max_num_seqs: int) -> tuple[int, int]:
    """The ``(seq, chunk)`` of a padding row."""
    if pad == "tail":
        return max_num_seqs, 0
    if pad == "negative":
        return -1, 0
    return 0, PAST_END_CHUNK


def padded(pad: str, max_num_seqs: int, max_rows: int) -> Layout:
    """The capacity-shaped layout: the same shapes whatever the batch (CUDA graphs)."""
    return Layout(padded_num_seqs(pad, max_num_seqs), max_rows, *padding_row(pad, max_num_seqs))


def bounded(pad: str, num_seqs: int, max_num_tokens: int, chunk_size: int) -> Layout:
    """Rows for ``num_seqs`` sequences of at most ``max_num_tokens`` tokens in all."""
    return Layout(num_seqs, chunk_row_bound(num_seqs, max_num_tokens, chunk_size), *padding_row(pad, num_seqs))


def chunk_row_bound(num_seqs: int, num_tokens: int, chunk_size: int) -> int:
    """The most chunk rows ``num_seqs`` sequences holding at most ``num_tokens`` tokens can need.

    ``NT = sum_i cdiv(len_i, C) <= sum_i (len_i + C - 1) / C <= (T + N (C - 1)) / C``; NT is an
    integer, so ``NT <= floor((T + N (C - 1)) / C)`` (reached when every length is 1 mod C), and
    a row holds at least one token, so ``NT <= T``. ``cdiv(T, C)`` alone is not a bound (two
    one-token sequences need two rows); ``cdiv(T, C) + N`` is, but looser by up to N rows.
    """
    if num_seqs <= 0 or num_tokens <= 0:
        return 0
    return min(num_tokens, (num_tokens + num_seqs * (chunk_size - 1)) // chunk_size)


def check_pad(pad: str, allowed: tuple[str, ...], max_num_tokens: int, chunk_size: int) -> None:
    """ChunkMetaError unless ``pad`` is one of ``allowed`` and safe for a builder of that size."""
    if pad not in allowed:
        raise ChunkMetaError(f"pad={pad!r}: must be one of {allowed}.")
    if pad == "past_end" and max_num_tokens > PAST_END_CHUNK * chunk_size:
        raise ChunkMetaError(
            f"pad='past_end' with max_num_tokens={max_num_tokens}: a sequence may then reach chunk "
            f"PAST_END_CHUNK={PAST_END_CHUNK}; use pad='negative', or max_num_tokens <= {PAST_END_CHUNK * chunk_size}."
        )
