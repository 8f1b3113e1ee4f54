"""Radix-cache tracking indices of an extend without the device read SGLang's own code makes.

``MambaAttnBackendBase._init_track_conv_indices`` (``srt/layers/attention/hybrid_linear_attn_backend.py``)
bounds the conv-state positions it gathers with ``query_start_loc[-1] - 1``: a 0-d device tensor
passed where ``clamp`` takes a Python scalar, so torch reads it back (a sync per forward). That bound
is the forward's token count, which the host holds whenever ``extend_seq_lens_cpu`` is trusted; the
positions themselves come from device tensors SGLang already made (the tracked rows, from the host
mask, and ``ForwardBatch.mamba_track_aligned_lens``). Same values and dtype, no read.

Host data only on the host side; nothing here reads device memory.
"""

from __future__ import annotations

import torch

from chunkmeta.integrations.sglang import sizing


def host_num_tokens(forward_batch, query_start_loc) -> int | None:
    """The forward's token count from trusted host lengths (SGLang's own ``logical_num_tokens``), or None."""
    lens = sizing.trusted_extend_lens(forward_batch, query_start_loc.shape[0] - 1)
    return None if lens is None else int(sum(lens))


def track_conv_indices(
    query_start_loc: torch.Tensor,
    aligned_lens: torch.Tensor,
    rows: torch.Tensor,
    conv_len: int,
    num_tokens: int,
) -> torch.Tensor:
    """``[len(rows), conv_len]`` flattened token positions of each tracked row's last ``conv_len``
    tokens before its aligned boundary, clamped into ``[0, num_tokens - 1]``.

    ``rows``: the tracked rows (int64, device); ``aligned_lens``: per row, the tracked tokens of
    this extend floored to the cache chunk (device); ``num_tokens``: a host int, so the clamp's
    bound is a Python scalar and nothing is read from the device."""
    ends = (query_start_loc[:-1] + aligned_lens).index_select(0, rows)
    window = torch.arange(-conv_len, 0, device=ends.device, dtype=ends.dtype)
    return (ends.unsqueeze(-1) + window).clamp_(0, num_tokens - 1)
