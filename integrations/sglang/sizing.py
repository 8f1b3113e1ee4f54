"""Sizes from SGLang's host data: a backend's capacity, and per forward its trusted host lengths or
a host bound on its tokens.

Host data only: nothing here reads device memory (that would be the sync chunkmeta removes).
"""

from __future__ import annotations

import numbers
import os

import torch

from chunkmeta.errors import ChunkMetaError


def _int(value) -> int | None:
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    return None


def _env_int(name: str) -> int | None:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ChunkMetaError(f"{name}={raw!r}: must be a positive int (or unset, to size from the server args).")
    return value


def backend_capacity(model_runner) -> tuple[int, int]:
    """``(max_num_seqs, max_num_tokens)`` of one forward of ``model_runner``.

    Sequences: the most of ``model_runner.max_running_requests``, ``server_args.max_running_requests``
    and ``req_to_token_pool.size`` (a forward never holds more requests than the pool). Tokens: one
    scheduled prefill batch holds at most ``max(chunked_prefill_size, max_prefill_tokens)`` tokens
    (the model's ``context_len`` instead of the chunk size when chunked prefill is off: the first
    request of a batch may exceed ``max_prefill_tokens``), plus one token per running request that
    a MIXED batch appends. DP padding pads to the largest rank's count, which obeys the same bound.
    ``CHUNKMETA_SGLANG_MAX_NUM_SEQS`` / ``CHUNKMETA_SGLANG_MAX_NUM_TOKENS`` override either.
    """
    server_args = getattr(model_runner, "server_args", None)
    pool = getattr(model_runner, "req_to_token_pool", None)
    seqs = [
        _int(getattr(model_runner, "max_running_requests", None)),
        _int(getattr(server_args, "max_running_requests", None)),
        _int(getattr(pool, "size", None)),
    ]
    max_num_seqs = _env_int("CHUNKMETA_SGLANG_MAX_NUM_SEQS") or max((s for s in seqs if s and s > 0), default=0)
    if not max_num_seqs:
        raise ChunkMetaError(
            f"model_runner={type(model_runner).__name__}: found no max_running_requests or req_to_token_pool.size "
            "to size chunk tables from; set CHUNKMETA_SGLANG_MAX_NUM_SEQS."
        )
    chunked = _int(getattr(server_args, "chunked_prefill_size", None))
    context = _int(getattr(getattr(model_runner, "model_config", None), "context_len", None)) or _int(
        getattr(server_args, "context_length", None)
    )
    per_batch = [
        _int(getattr(server_args, "max_prefill_tokens", None)),
        chunked if chunked and chunked > 0 else context,
    ]
    max_num_tokens = _env_int("CHUNKMETA_SGLANG_MAX_NUM_TOKENS")
    if max_num_tokens is None:
        prefill = max((t for t in per_batch if t and t > 0), default=0)
        if not prefill:
            raise ChunkMetaError(
                "server_args has no chunked_prefill_size, max_prefill_tokens or context length to size chunk "
                "tables from; set CHUNKMETA_SGLANG_MAX_NUM_TOKENS."
            )
        max_num_tokens = prefill + max_num_seqs
    return max_num_seqs, max_num_tokens


def trusted_extend_lens(forward_batch, num_rows: int):
    """``extend_seq_lens_cpu`` when SGLang itself trusts it for this batch, else None: present, one
    entry per row, and not a two-batch-overlap child (the same test as MambaAttnBackendBase)."""
    lens = getattr(forward_batch, "extend_seq_lens_cpu", None)
    if lens is None or len(lens) != num_rows:
        return None
    if getattr(forward_batch, "tbo_parent_token_range", None) is not None:
        return None
    return lens


def token_bound(forward_batch, forward_metadata) -> int | None:
    """A host upper bound on the tokens of the forward, without reading device memory.

    ``forward_metadata.logical_num_tokens`` first (SGLang >= 0.5.21 sets it on every extend: the sum
    of the host lengths, or its own read of ``query_start_loc[-1]``); then ``extend_num_tokens``
    (the real count, or under DP padding the padded count, still an upper bound); then the number
    of input tokens (a host shape: every token the kernels see is one of them).
    """
    for value in (
        getattr(forward_metadata, "logical_num_tokens", None),
        getattr(forward_batch, "extend_num_tokens", None),
    ):
        value = _int(value)
        if value is not None and value >= 0:
            return value
    input_ids = getattr(forward_batch, "input_ids", None)
    if isinstance(input_ids, torch.Tensor) and input_ids.dim() >= 1:
        return int(input_ids.shape[0])
    return None
