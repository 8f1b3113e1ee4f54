"""What bench/vllm_full_graph.py's parts share: the random mixed batches, the request buckets,
the model (``vllm_step_loop``'s layer, weights and vLLM's ops) with one set of states per method,
vLLM's eager linear-attention path and the graph-safe one, and the bucket's staging from vLLM's
common metadata. Imported after the script has set up the interpreter (``--smoke``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch
import vllm_step_loop as loop

# how a piece is captured: "cuda" (CUDA graphs), "simulate" (CPU: the graph's contract with no
# graph, so that the smoke runs the capture and replay paths), "off" (eager), "breakable" (vLLM's
# breakable capture, as Kimi-Linear's piecewise graphs hold the KDA: the piece in a segment, then
# an eager break where an MLA layer makes one)
CAPTURE_MODES = ("cuda", "simulate", "off", "breakable")

REQUEST_BUCKETS = (8, 16, 32, 64, 128, 256)


def request_bucket(requests: int) -> int:
    return next(b for b in REQUEST_BUCKETS if b >= requests)


def random_batch(rng: np.random.Generator, requests: int, tokens: int) -> tuple[list[int], list[int]]:
    """``(query_lens, context_lens)`` of a mixed batch of ``requests`` rows and at most ``tokens``
    tokens, decodes first (vLLM's order): decodes, then prefill chunks (a fresh prompt or a later
    chunk over a cached prefix), sometimes trailing zero-length rows; one row over one token."""
    padding = int(rng.integers(0, 3)) if requests > 2 and rng.random() < 0.3 else 0
    real = requests - padding
    prefills = int(rng.integers(1, real + 1))
    decodes = real - prefills
    budget = tokens - decodes
    if budget < 2 * prefills:  # every prefill at least 2 tokens
        prefills = max(1, budget // 2)
        decodes = real - prefills
        budget = tokens - decodes
    cuts = (
        np.sort(rng.choice(np.arange(1, budget - prefills + 1), size=prefills - 1, replace=False))
        if prefills > 1
        else []
    )
    sizes = np.diff(np.concatenate([[0], cuts, [budget - prefills]])).astype(int) + 1
    sizes[sizes < 2] = 2
    sizes[-1] -= int(sizes.sum()) - budget  # the chunks fill the step
    if sizes[-1] < 1:
        sizes[-1] = 1
    query = [1] * decodes + [int(s) for s in sizes] + [0] * padding
    context = [int(rng.integers(16, 4000)) for _ in range(decodes)]
    context += [0 if rng.random() < 0.4 else int(rng.integers(1, 8192)) for _ in sizes]
    context += [int(rng.integers(0, 100)) for _ in range(padding)]
    return query, context


def blocks_equal(a, b) -> bool:
    """Two sets of layer states (per layer, the conv and recurrent state tensors) bit for bit, the
    null block 0 left out: padded rows write there."""
    return all(torch.equal(x[1:], y[1:]) for pa, pb in zip(a, b, strict=True) for x, y in zip(pa, pb, strict=True))


class Bench:
    """The model (``loop.Engine``'s weights, runner buffers and stock / chunkmeta builders) and
    a set of states per method."""

    def __init__(self, shape, builders, ops, max_reqs, max_tokens, device, methods):
        from chunkmeta.integrations.vllm import routing
        from chunkmeta.integrations.vllm.mixed_step import KdaOps

        self.engine = loop.Engine(shape, {m: None for m in methods}, ops, max_reqs, max_tokens, device)
        self.builders = builders
        self.shape, self.ops, self.device = shape, ops, device
        self.kda_ops = KdaOps(
            ops.causal_conv1d_fn, ops.gather_initial_states, ops.chunk_kda_with_fused_gate, routing.router()
        )

    def states_equal(self, a: str, b: str) -> bool:
        return blocks_equal(self.engine.caches[a], self.engine.caches[b])

    def conv_views(self, cache):
        conv_state = cache[0] if self.ops.conv_dim_first else cache[0].transpose(-1, -2)
        return conv_state.split(self.shape.proj, dim=-2)


def linear_attention_eager(bench: Bench, m, mixed_qkv, g1, beta, w, cache) -> torch.Tensor:
    """vLLM's eager non-spec path with prefills on the real tokens."""
    return loop.linear_attention(bench.ops, bench.shape, m, mixed_qkv, g1, beta, w, cache)


def linear_attention_mixed(bench: Bench, inputs, mixed_qkv, g1, beta, w, cache) -> torch.Tensor:
    from chunkmeta.integrations.vllm.mixed_step import kda_mixed_forward

    s = bench.shape
    weights = w.conv1d.view(w.conv1d.size(0), w.conv1d.size(2)).split(s.proj, dim=0)
    return kda_mixed_forward(
        bench.kda_ops, inputs, mixed_qkv=mixed_qkv, g1=g1, beta=beta, conv_weights=tuple(weights),
        conv_states=tuple(bench.conv_views(cache)), recurrent_state=cache[1], A_log=w.A_log, dt_bias=w.dt_bias,
        lower_bound=None, head_dim=s.head_dim,
    )  # fmt: skip


def stage_args(m) -> tuple:
    """``MixedStepInputs.stage``'s arguments from vLLM's common metadata, as the chunkmeta builder
    passes them for a captured mixed step."""
    return m.query_start_loc, m.query_start_loc_cpu, m.block_table_tensor[:, 0], m.compute_num_computed_tokens()


def stage(inputs, m) -> None:
    """What the chunkmeta builder does for a captured mixed step, from vLLM's common metadata."""
    inputs.stage(*stage_args(m))


class Captured(NamedTuple):
    replay: Callable[[], None]
    out: object  # what the captured function returned: the static output each replay rewrites
    seconds: float | None  # capture time (CUDA)
    pool_bytes: int | None  # the graph pool's growth (CUDA)
    segments: tuple[int, int] | None = None  # "breakable": (graphs, eager breaks)


def capture(fn, mode: str, keep=()) -> Captured:
    """``fn`` captured once; warm it up first (Triton compiles and tunes outside a capture).
    ``"cuda"``: a CUDA graph. ``"simulate"``: ``fn`` runs now with the tensors of ``keep`` put back
    after it (a capture runs nothing) and again at each replay, its result copied into the first
    one's: a graph's static-output contract without a graph."""
    if mode == "cuda":
        torch.cuda.synchronize()
        # torch.cuda.graph() starts with empty_cache(): without it here, the cache it frees would
        # come off the pool's growth (a first H100 run reported -1.6 GiB)
        torch.cuda.empty_cache()
        graph, before, start = torch.cuda.CUDAGraph(), torch.cuda.memory_reserved(), time.perf_counter()
        with torch.cuda.graph(graph):
            out = fn()
        return Captured(graph.replay, out, time.perf_counter() - start, torch.cuda.memory_reserved() - before)
    if mode == "breakable":
        return _breakable(fn)
    if mode != "simulate":
        raise ValueError(f"capture mode {mode!r}: one of {CAPTURE_MODES}")
    saved = [t.clone() for t in keep]
    out = fn()
    for t, before in zip(keep, saved, strict=True):
        t.copy_(before)

    def replay():
        again = fn()
        if out is not None:
            out.copy_(again)

    return Captured(replay, out, None, None)


def _breakable(fn) -> Captured:
    """``fn`` captured in vLLM's ``BreakableCUDAGraphCapture`` followed by an eager break (no
    work: it ends ``fn``'s segment as the next MLA layer does in Kimi-Linear), on a side stream as
    vLLM's capture runs; replayed segment by segment."""
    from vllm.compilation.breakable_cudagraph import BreakableCUDAGraphCapture, eager_break_during_capture

    @eager_break_during_capture
    def attention_break():
        pass

    cuda = torch.cuda.is_available()
    stream = torch.cuda.Stream() if cuda else None
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    before, start = torch.cuda.memory_reserved() if cuda else 0, time.perf_counter()
    with (
        torch.cuda.stream(stream),  # (None: no-op, off CUDA)
        BreakableCUDAGraphCapture(pool=torch.cuda.graph_pool_handle() if cuda else None) as graphs,
    ):
        out = fn()
        attention_break()
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    pool = torch.cuda.memory_reserved() - before if cuda else None
    return Captured(graphs.replay, out, seconds, pool, (graphs.num_graphs, graphs.num_eager_breaks))
