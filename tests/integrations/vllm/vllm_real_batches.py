"""Runner-shaped batches for the real-vLLM tests: CommonAttentionMetadata as vLLM's runner makes
it (rows decode-first, padding rows zero-length at the end) and a builder's build() on one; and
the tiny offline model configs the tests and bench/vllm_builders.py build vLLM's configs from."""

import os

import numpy as np
import torch

# The builders are driven here as vLLM's V1 model runner drives them. Under the V2 runner (vLLM's
# default where Triton has a GPU driver) the runner computes Kimi-K3's aligned Mamba state indices
# before each build(), and that builder asserts they are there; no runner runs here.
os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")


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


def full_padded_metadata(query_lens, context_lens, num_reqs_padded, num_tokens_padded, device):
    """What vLLM's runner builds under FULL: trailing zero-length requests up to the key's request
    count (their block is the null block 0, their seq_len 0), ``num_actual_tokens`` the bucket."""
    pad = num_reqs_padded - len(query_lens)
    query, context = list(query_lens) + [0] * pad, list(context_lens) + [0] * pad
    m = common_metadata(query, context, device)
    m.block_table_tensor[len(query_lens) :] = 0  # vLLM's null block
    return m.replace(num_actual_tokens=num_tokens_padded, max_query_len=max(max(query), 1))


def capture_metadata(tokens, reqs, device, uniform=False):
    """vLLM's dummy capture batch: ``tokens`` spread over ``reqs`` requests, seq_len == query_len,
    ``max_query_len`` 1 for a uniform decode capture and ``tokens`` for a mixed one, whatever
    the spread (gpu_model_runner.py:5519)."""
    per, extra = divmod(tokens, reqs)
    query = [per + (i < extra) for i in range(reqs)]
    m = common_metadata(query, [0] * reqs, device)
    return m.replace(is_prefilling=torch.zeros(reqs, dtype=torch.bool), max_query_len=1 if uniform else tokens)


def random_mixed(rng, reqs_max, tokens_max):
    """``(query_lens, context_lens)`` of a mixed batch in vLLM's order: one-token decodes over a
    cached prefix, then prefill chunks of at least one token, fresh or over a cached prefix."""
    real = int(rng.integers(1, reqs_max + 1))
    decodes = int(rng.integers(0, real))
    prefills = real - decodes
    budget = int(rng.integers(decodes + prefills, tokens_max + 1)) - decodes
    sizes = rng.multinomial(budget - prefills, [1 / prefills] * prefills) + 1
    query = [1] * decodes + [int(s) for s in sizes]
    context = [int(rng.integers(1, 500)) for _ in range(decodes)]
    context += [0 if rng.random() < 0.5 else int(rng.integers(1, 500)) for _ in sizes]
    return query, context


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


# -- tiny models (offline: a config saved to a directory, no weights) ---------------------------


def tiny_qwen3_next(linear_head_dim: int = 16):
    """A Qwen3-Next (GDN) model config; the builders read none of its sizes, the layers' ops do
    (the GPU test and the benchmarks use the real 128-wide linear heads)."""
    from transformers import Qwen3NextConfig

    return Qwen3NextConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=128, linear_key_head_dim=linear_head_dim, linear_value_head_dim=linear_head_dim,
        linear_num_key_heads=2, linear_num_value_heads=4, moe_intermediate_size=32, num_experts=4,
        num_experts_per_tok=2,
    )  # fmt: skip


def tiny_mamba2(chunk_size: int):
    """A Mamba2 model config with the SSD chunk size its builder reads."""
    from transformers import Mamba2Config

    return Mamba2Config(
        hidden_size=64, num_hidden_layers=2, num_heads=4, head_dim=32, state_size=16, n_groups=1, vocab_size=128,
        chunk_size=chunk_size, expand=2,
    )  # fmt: skip


def model_config(hf_config, path: str, max_model_len: int = 4096, **kwargs):
    """vLLM's ModelConfig of ``hf_config``, saved to ``path`` first (no tokenizer: skipped)."""
    from vllm.config import ModelConfig

    hf_config.save_pretrained(path)
    return ModelConfig(
        model=path, tokenizer=path, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=max_model_len, **kwargs
    )


def scheduler_config(max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int = 4096):
    from vllm.config import SchedulerConfig

    return SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        is_encoder_decoder=False,
    )


def ngram_speculative(model):
    """Ngram spec decode of two tokens over ``model`` (no draft model to load)."""
    from vllm.config import ParallelConfig, SpeculativeConfig

    return SpeculativeConfig(
        method="ngram",
        num_speculative_tokens=2,
        prompt_lookup_max=3,
        prompt_lookup_min=1,
        target_model_config=model,
        target_parallel_config=ParallelConfig(),
    )
