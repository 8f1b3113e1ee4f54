"""Runner-shaped batches for the real-vLLM tests: CommonAttentionMetadata as vLLM's runner makes
it (rows decode-first, padding rows zero-length at the end) and a builder's build() on one."""

import torch


def common_metadata(query_lens, context_lens, device):
    from vllm.v1.attention.backend import CommonAttentionMetadata

    n = len(query_lens)
    lens = torch.tensor(query_lens, dtype=torch.int32)
    qsl = torch.zeros(n + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(lens, 0)
    seq_lens = torch.tensor([q + c for q, c in zip(query_lens, context_lens, strict=True)], dtype=torch.int32)
    num_tokens = int(qsl[-1])
    columns = max(64, -(-int(seq_lens.max()) // 16) + 1)  # enough 16-token blocks for the longest row
    return CommonAttentionMetadata(
        query_start_loc=qsl.to(device),
        query_start_loc_cpu=qsl,
        seq_lens=seq_lens.to(device),
        num_reqs=n,
        num_actual_tokens=num_tokens,
        max_query_len=max(query_lens),
        max_seq_len=int(seq_lens.max()),
        block_table_tensor=torch.arange(n * columns, dtype=torch.int32, device=device).view(n, columns),
        slot_mapping=torch.arange(num_tokens, dtype=torch.int64, device=device),
        causal=True,
        is_prefilling=torch.tensor([c == 0 and q > 0 for q, c in zip(query_lens, context_lens, strict=True)]),
        seq_lens_cpu_upper_bound=seq_lens.clone(),
    )


def build(builder, case, device):
    """``builder.build`` on ``case`` = (query_lens, context_lens, num_decode_draft_tokens or None)."""
    query_lens, context_lens, drafts = case
    m = common_metadata(query_lens, context_lens, device)
    if drafts is None:
        return builder.build(0, m)
    return builder.build(
        0,
        m,
        num_accepted_tokens=torch.ones(len(query_lens), dtype=torch.int32, device=device),
        num_decode_draft_tokens_cpu=torch.tensor(drafts, dtype=torch.int32),
    )
