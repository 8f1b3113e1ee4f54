"""Engine-like batches for tests, benchmarks, stress runs and the demo trace.

A batch is what a scheduler hands over: ``query_start_loc`` as a list (cumulative query lengths
of every request in the step), the prefill slice ``(first_seq, num_seqs)`` and, where known, each
request's ``num_computed_tokens`` (tokens already in its cache: what Mamba2's tables cut chunks
on). Generators are seeded and pure numpy: the same seed gives the same batch on every machine.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class Batch(NamedTuple):
    query_start_loc: list[int]
    first_seq: int
    num_seqs: int
    num_computed_tokens: list[int] | None = None  # per request of the batch; None: not known

    @property
    def num_tokens(self) -> int:
        q = self.query_start_loc
        return q[self.first_seq + self.num_seqs] - q[self.first_seq]


def from_lengths(lengths, first_seq: int = 0, start: int = 0) -> Batch:
    """Batch whose prefill slice starts at ``first_seq`` (requests before it are the decodes)."""
    qsl = [start]
    for n in lengths:
        qsl.append(qsl[-1] + int(n))
    return Batch(qsl, first_seq, len(lengths) - first_seq)


def split_tokens(rng: np.random.Generator, num_seqs: int, num_tokens: int) -> list[int]:
    """``num_seqs`` lengths >= 1 summing to ``num_tokens`` (uneven, like real prompts)."""
    if num_seqs == 1:
        return [num_tokens]
    if num_tokens < num_seqs:
        raise ValueError(f"{num_tokens} tokens cannot give {num_seqs} sequences of at least one token")
    weights = rng.lognormal(0.0, 1.0, num_seqs)
    lengths = np.maximum(1, np.floor(weights / weights.sum() * num_tokens)).astype(np.int64)
    lengths[np.argmax(lengths)] += num_tokens - int(lengths.sum())
    if lengths.min() < 1:
        # With few tokens per sequence, rounding every share up to 1 overdraws the budget: give
        # each sequence its one token first and share out the rest. (Kept as a fallback so that
        # the batches the benchmarks recorded stay the same.)
        lengths = 1 + np.floor(weights / weights.sum() * (num_tokens - num_seqs)).astype(np.int64)
        lengths[np.argmax(lengths)] += num_tokens - int(lengths.sum())
    return lengths.tolist()


def workload(num_seqs: int, num_tokens: int, seed: int = 0) -> Batch:
    """A prefill-only batch of exactly ``num_seqs`` sequences and ``num_tokens`` tokens."""
    return from_lengths(split_tokens(np.random.default_rng(seed), num_seqs, num_tokens))


def random_decode_first(rng: np.random.Generator, max_seqs: int, max_tokens: int, chunk_size: int = 64) -> Batch:
    """A decode-first mixed batch (vLLM's order): one-token decodes, then prefills whose lengths
    mix zero-length padding rows, one-token prompts, lengths around multiples of the chunk size
    and long prompts. The prefill slice starts after the decodes."""
    num_requests = int(rng.integers(1, max_seqs + 1))
    num_decodes = min(int(rng.integers(0, num_requests + 1)), max_tokens)
    kinds = rng.integers(0, 5, num_requests - num_decodes)
    lengths = []
    for kind in kinds:
        if kind == 0:
            lengths.append(0)
        elif kind == 1:
            lengths.append(1)
        elif kind == 2:
            lengths.append(max(0, int(rng.integers(1, 5)) * chunk_size + int(rng.integers(-1, 2))))
        else:
            lengths.append(int(rng.integers(1, 3 * chunk_size)))
    budget = max(0, max_tokens - num_decodes)
    total = sum(lengths)
    if total > budget:  # scale down to the token budget, keeping zero/one-token rows
        lengths = [min(n, 1) if n <= 1 else max(1, n * budget // (total + 1)) for n in lengths]
        while sum(lengths) > budget:
            lengths[lengths.index(max(lengths))] -= 1
    start = int(rng.integers(0, 3)) * 7  # query_start_loc need not start at 0
    return from_lengths([1] * num_decodes + lengths, first_seq=num_decodes, start=start)


def simulate_engine(
    seed: int = 0, num_steps: int = 50, token_budget: int = 4096, max_seqs: int = 64, pad_to: int = 4
) -> list[Batch]:
    """Steps of a decode-first engine with chunked prefill (vLLM's order), as a scheduler sees them.

    Each step: every running request decodes one token (first in the batch); then prefills fill
    the rest of the token budget, continuing a partly prefilled prompt before starting new ones
    (a long prompt is split over several steps: chunked prefill). Some steps are padded with
    zero-length rows up to a multiple of ``pad_to`` requests (as CUDA-graph and spec-decode
    padding leave them in the slice). Arrivals are scripted so the trace holds one-token prompts,
    one long prompt, mixed decode+prefill steps and steps with no prefill at all.

    Each step also has every request's ``num_computed_tokens``: a decode's context so far, a
    chunked prompt's earlier chunks (partial first chunks), 0 for padding rows, and prefix-cache
    hits on arrival (scripted, chunk-aligned ones of 64, 256 and 512 tokens and a partial one of
    100; they add no tokens to the step, so ``query_start_loc`` is what it was without them).
    """
    rng = np.random.default_rng(seed)
    # per request: (prompt tokens still to prefill, tokens already computed), partly prefilled first
    queue: list[tuple[int, int]] = []
    decoding: list[tuple[int, int]] = []  # per running request: (tokens left to generate, context)
    steps = []
    for step in range(num_steps):
        if step == 0:
            # cached prefixes: 512 before the 300-token prompt, 64 before the 65, 100 before the 129
            queue += [(1, 0), (1, 0), (300, 512), (64, 0), (65, 64), (129, 100), (2000, 0)]
        elif step == 12:
            queue.append((20_000, 0))  # one long prompt: chunked over several steps
        elif step == 30:
            queue += [(1, 0)] * 6  # a burst of one-token prompts
        elif step not in (20, 21, 22) and rng.random() < 0.6:  # 20-22: decode-only steps
            cached = 256 * (step % 3)  # a prefix-cache hit on some arrivals (no draw from rng)
            queue += [(int(n), cached) for n in rng.integers(1, 1500, int(rng.integers(1, 4)))]
        num_decodes = len(decoding)
        lengths = [1] * num_decodes
        computed = [context for _, context in decoding]
        budget = token_budget - num_decodes
        still_queued = []
        prompts_done = []  # each finished prompt's context
        for left, done in queue:
            if budget <= 0 or len(lengths) >= max_seqs:
                still_queued.append((left, done))
                continue
            take = min(left, budget)
            lengths.append(take)
            computed.append(done)
            budget -= take
            if take < left:
                still_queued.insert(0, (left - take, done + take))  # a chunked prompt continues first next step
            else:
                prompts_done.append(done + take)
        queue = still_queued
        if step % 3 == 1 and len(lengths) % pad_to:
            pad = pad_to - len(lengths) % pad_to
            lengths += [0] * pad
            computed += [0] * pad
        steps.append(from_lengths(lengths, first_seq=num_decodes)._replace(num_computed_tokens=computed))
        decoding = [(n - 1, context + 1) for n, context in decoding if n > 1] + [
            (int(rng.integers(2, 12)), context) for context in prompts_done
        ]
    return steps
