"""Runner-shaped batches for the real-vLLM tests: CommonAttentionMetadata as vLLM's runner makes
it (rows decode-first, padding rows zero-length at the end) and a builder's build() on one."""

import numpy as np
import torch


def common_metadata(query_lens, context_lens, device):
    n = len(query_lens)
    lens = torch.tensor(query_lens, dtype=torch.int32)
    qsl = torch.zeros(n + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(lens, 0)
    seq_lens = torch.tensor([q + c for q, c in zip(query_lens, context_lens, strict=True)], dtype=torch.int32)
    num_tokens = int(qsl[-1])
    columns = max(64, -(-int(seq_lens.max()) // 16) + 1)  # enough 16-token blocks for the longest row
    return _common_metadata(
        query_lens,
        context_lens,
        qsl.to(device),
        qsl,
        seq_lens.to(device),
        seq_lens,
        torch.arange(n * columns, dtype=torch.int32, device=device).view(n, columns),
        torch.arange(num_tokens, dtype=torch.int64, device=device),
    )


def _common_metadata(query_lens, context_lens, qsl, qsl_cpu, seq_lens, seq_lens_cpu, block_table, slot_mapping):
    from vllm.v1.attention.backend import CommonAttentionMetadata

    return CommonAttentionMetadata(
        query_start_loc=qsl,
        query_start_loc_cpu=qsl_cpu,
        seq_lens=seq_lens,
        num_reqs=len(query_lens),
        num_actual_tokens=int(qsl_cpu[-1]),
        max_query_len=max(query_lens),
        max_seq_len=int(seq_lens_cpu.max()),
        block_table_tensor=block_table,
        slot_mapping=slot_mapping,
        causal=True,
        is_prefilling=torch.tensor([c == 0 and q > 0 for q, c in zip(query_lens, context_lens, strict=True)]),
        seq_lens_cpu_upper_bound=seq_lens_cpu.clone(),
    )


class RunnerBuffers:
    """A GPU model runner's step inputs: persistent host buffers (pinned on CUDA) and device
    buffers, written on the host each step and copied to the device without blocking, as vLLM's
    runner stages them; each step's CommonAttentionMetadata holds fresh views of them (a new
    ``query_start_loc`` object every step, as the runner slices its buffer). Mamba-style block
    table: one state block per request, request ``i`` in block ``i + 1`` (block 0 is vLLM's null
    block)."""

    def __init__(self, max_reqs: int, max_tokens: int, device):
        pin = torch.device(device).type == "cuda"

        def pair(*shape):
            host = torch.zeros(*shape, dtype=torch.int32, pin_memory=pin)
            return host, torch.zeros(*shape, dtype=torch.int32, device=device)

        self.qsl_cpu, self.qsl = pair(max_reqs + 1)
        self.seq_lens_cpu, self.seq_lens = pair(max_reqs)
        self.block_table_cpu, self.block_table = pair(max_reqs, 1)
        self.slot_mapping = torch.arange(max_tokens, dtype=torch.int64, device=device)

    def common_metadata(self, query_lens, context_lens):
        n = len(query_lens)
        qsl = self.qsl_cpu.numpy()
        qsl[0] = 0
        np.cumsum(query_lens, out=qsl[1 : n + 1])
        self.seq_lens_cpu.numpy()[:n] = np.add(query_lens, context_lens)
        self.block_table_cpu.numpy()[:n, 0] = np.arange(1, n + 1)
        self.qsl[: n + 1].copy_(self.qsl_cpu[: n + 1], non_blocking=True)
        self.seq_lens[:n].copy_(self.seq_lens_cpu[:n], non_blocking=True)
        self.block_table[:n].copy_(self.block_table_cpu[:n], non_blocking=True)
        return _common_metadata(
            query_lens,
            context_lens,
            self.qsl[: n + 1],
            self.qsl_cpu[: n + 1],
            self.seq_lens[:n],
            self.seq_lens_cpu[:n],
            self.block_table[:n],
            self.slot_mapping[: int(qsl[n])],
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
