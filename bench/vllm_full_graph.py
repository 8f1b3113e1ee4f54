"""Issue 34: a Kimi-Linear mixed prefill+decode step in one CUDA graph, on vLLM 0.33.0's own ops.

    python bench/vllm_full_graph.py --out DIR [--exact-batches 200] [--steps 30] [--layers 24]
    python bench/vllm_full_graph.py --smoke --out DIR   (CPU, vLLM's ops under Triton's interpreter)

Two parts, each a record (``bench/results.py``: ``vllm_full_graph.runs.jsonl``) under ``--out``:

**exact**: one KDA layer's linear-attention part (three ``causal_conv1d_fn``, vLLM's
``gather_initial_states``, the vendored ``chunk_kda_with_fused_gate``, the state write-back)
over ``--exact-batches`` random mixed batches of one bucket. ``chunkmeta_full``: captured once
(``integrations/vllm/mixed_step.kda_mixed_forward`` on a ``MixedStepInputs`` bucket), each batch
staged and the graph replayed. Reference: vLLM's eager path on the same batch, exact shapes, the
stock builder's metadata. Compared bit for bit (``torch.equal``): the output of every real token,
every real block's recurrent and conv states. Batches: decodes, prefill chunks with and without
a cached prefix, sometimes trailing zero-length rows (vLLM leaves them in the slice under spec
decode); at least one row over one token, so that vLLM's eager path is the chunked one (a
decode-only batch takes its recurrent decode kernel, which is not the same arithmetic).

**steps**: the whole step of ``--layers`` KDA layers (``bench/vllm_step_loop.py``'s layer:
input GEMMs, the linear-attention part, ``o_proj``), a new random batch every step, per shape
(requests x tokens), methods interleaved:

* ``vllm_piecewise``     what vLLM runs for a mixed step: the GEMM pieces between the
                         linear-attention ops captured as CUDA graphs for the token bucket (vLLM's
                         piecewise / breakable graphs), the linear-attention ops eager on the real
                         tokens, vLLM's metadata (the stock builder; the KDA op's own
                         ``prepare_chunk_indices``, with its sync);
* ``chunkmeta_piecewise`` the same with chunkmeta's builder (no sync);
* ``chunkmeta_full``     the whole step one graph per bucket (tokens x requests), captured once,
                         ``stage()`` + replay per step.

Reported per shape: ms/step (medians), syncs per step (``set_sync_debug_mode("warn")``), graph
memory (the pool's reserved bytes) and capture time per bucket, and whether ``chunkmeta_full``'s
outputs and states equal ``vllm_piecewise``'s (both run their GEMMs at the bucket's token count).

``--smoke`` (CPU): tiny shapes, no graphs (CUDA only): every path runs eagerly, the graph-safe
forward on its padded bucket, so the exactness check still compares padded against exact shapes;
vLLM's CPU conv (torch; the interpreter cannot run its Triton conv) reads no conv table.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import warnings

SMOKE = "--smoke" in sys.argv[1:]
if SMOKE:  # before torch and triton are imported: the interpreter is chosen at import
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import numpy as np  # noqa: E402
import results as runs  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import vllm_builders  # noqa: E402
import vllm_step_loop as loop  # noqa: E402  the layer, its weights and vLLM's ops

from chunkmeta.timing import interleaved_ms, median  # noqa: E402

METHODS = ("vllm_piecewise", "chunkmeta_piecewise", "chunkmeta_full")
SHAPES = ((8, 256), (8, 1024), (8, 4096), (32, 512), (64, 4096))  # (requests, tokens)
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
        self.buckets: dict[tuple, object] = {}

    def states_equal(self, a: str, b: str) -> bool:
        """Every layer's conv and recurrent states, the null block 0 left out (padded rows write there)."""
        ca, cb = self.engine.caches[a], self.engine.caches[b]
        return all(
            torch.equal(x[1:], y[1:]) for pa, pb in zip(ca, cb, strict=True) for x, y in zip(pa, pb, strict=True)
        )

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


def stage(inputs, m) -> None:
    """What the chunkmeta builder does for a captured mixed step, from vLLM's common metadata."""
    inputs.stage(
        m.query_start_loc,
        m.query_start_loc_cpu,
        m.block_table_tensor[:, 0],
        m.compute_num_computed_tokens(),
    )


# -- exact: one layer's linear-attention part, graph replays against vLLM's eager path ----------


class KdaCase:
    """Kimi-Linear's KDA layer 0 of the bench: its inputs, vLLM's eager path, the graph-safe one."""

    name = "kda"

    def __init__(self, bench: Bench, tokens: int):
        s, dev = bench.shape, bench.device
        self.bench, self.w = bench, bench.engine.layers[0]
        self.static = {
            "mixed_qkv": torch.zeros(tokens, 3 * s.proj, dtype=s.dtype, device=dev),
            "g1": torch.zeros(1, tokens, s.heads, s.head_dim, dtype=s.dtype, device=dev),
            "beta": torch.zeros(1, tokens, s.heads, dtype=s.dtype, device=dev),
        }
        self.ref_cache, self.graph_cache = (bench.engine.caches[m][0] for m in ("vllm_piecewise", "chunkmeta_full"))

    def batch(self, rng, requests, tokens):
        return random_batch(rng, requests, tokens)

    def eager(self, metadata):
        x = self.static
        return linear_attention_eager(self.bench, metadata, x["mixed_qkv"], x["g1"], x["beta"], self.w, self.ref_cache)

    def mixed(self, inputs, cache):
        x = self.static
        return linear_attention_mixed(self.bench, inputs, x["mixed_qkv"], x["g1"], x["beta"], self.w, cache)


class GdnCase:
    """A Qwen3-Next GDN layer (its own random weights and states; heads as ``--heads``: HK = H / 2
    key heads, HV = H value heads): vLLM's eager non-spec path with the stock builder's tables
    (``_forward_core``: one conv over every row, ``fused_post_conv_prep``, the chunked rule on the
    prefill slice), against ``gdn_mixed_forward``. ``decodes=False``: batches without decode rows,
    compared bit for bit. ``decodes=True``: mixed batches, on which vLLM peels the decodes off onto
    ``fused_sigmoid_gating_delta_rule_update`` (qwen_gdn_linear_attn.py:1783-1802), another
    kernel than the chunked rule they take here: the prefill rows' outputs and states and every
    conv state compared bit for bit, the decode rows' outputs and recurrent states by their
    largest absolute difference (the stated tolerance)."""

    def __init__(self, bench: Bench, tokens: int, blocks: int, decodes: bool = False):
        from vllm.third_party.flash_linear_attention.ops import fused_post_conv_prep
        from vllm.third_party.flash_linear_attention.ops.chunk import chunk_gated_delta_rule
        from vllm.third_party.flash_linear_attention.ops.fused_sigmoid_gating import (
            fused_sigmoid_gating_delta_rule_update,
        )

        from chunkmeta.integrations.vllm.mixed_step import GdnOps

        s, dev = bench.shape, bench.device
        # vLLM's chunked GDN rule takes no float32 (its assert); Triton's interpreter computes a
        # bfloat16 tl.dot wrongly, a float16 one right: float16 on CPU
        dtype = torch.bfloat16 if dev.type == "cuda" else torch.float16
        self.bench, self.decodes = bench, decodes
        self.name = "gdn_with_decodes" if decodes else "gdn"
        self.hk, self.hv, self.d = max(1, s.heads // 2), s.heads, s.head_dim
        conv_dim = (2 * self.hk + self.hv) * self.d
        gen = torch.Generator(device=dev).manual_seed(1)
        self.conv_weight = (torch.randn(conv_dim, 4, generator=gen, device=dev) / 2).to(dtype)
        self.A_log = torch.log(torch.rand(self.hv, generator=gen, device=dev) * 15 + 1)
        self.dt_bias = torch.randn(self.hv, generator=gen, device=dev) * 0.1
        self.ops = GdnOps(bench.ops.causal_conv1d_fn, fused_post_conv_prep, chunk_gated_delta_rule)
        self.recurrent_decode = fused_sigmoid_gating_delta_rule_update
        self.static = {
            "mixed_qkv": torch.zeros(tokens, conv_dim, dtype=dtype, device=dev),
            "a": torch.zeros(tokens, self.hv, dtype=dtype, device=dev),
            "b": torch.zeros(tokens, self.hv, dtype=dtype, device=dev),
        }

        def cache():
            return (
                torch.zeros(blocks, conv_dim, 3, dtype=dtype, device=dev),
                torch.zeros(blocks, self.hv, self.d, self.d, dtype=torch.float32, device=dev),
            )

        self.ref_cache, self.graph_cache = cache(), cache()
        self.split = (0, 0)  # the last eager batch's (decode rows, decode tokens)

    def batch(self, rng, requests, tokens):
        query, context = random_batch(rng, requests, tokens)
        if self.decodes:
            return query, context
        keep = [i for i, (q, c) in enumerate(zip(query, context, strict=True)) if not (q == 1 and c > 0)]
        return [query[i] for i in keep], [context[i] for i in keep]  # no decode rows

    def eager(self, m):
        n, x = m.num_actual_tokens, self.static
        conv_state, ssm_state = self.ref_cache
        conv = self.ops.causal_conv1d_fn(
            x["mixed_qkv"][:n].transpose(0, 1), self.conv_weight, None, activation="silu", conv_states=conv_state,
            has_initial_state=m.has_initial_state, cache_indices=m.non_spec_state_indices_tensor,
            query_start_loc=m.non_spec_query_start_loc, metadata=m,
        ).transpose(0, 1)  # fmt: skip
        split = m.num_decodes if m.num_prefills > 0 else 0  # vLLM's split_non_spec
        d = m.num_decode_tokens if split else 0
        self.split = (split, d)
        q, k, v, g, beta = self.ops.fused_post_conv_prep(
            conv_output=conv[d:], a=x["a"][d:n], b=x["b"][d:n], A_log=self.A_log, dt_bias=self.dt_bias,
            num_k_heads=self.hk, head_k_dim=self.d, head_v_dim=self.d, apply_l2norm=True, output_g_exp=False,
        )  # fmt: skip
        outs = []
        if split:
            qd, kd, vd = (
                t.contiguous().unsqueeze(0) for t in conv[:d].split([self.hk * self.d] * 2 + [self.hv * self.d], -1)
            )
            out_d, _ = self.recurrent_decode(
                A_log=self.A_log, a=x["a"][:d], b=x["b"][:d], dt_bias=self.dt_bias,
                q=qd.view(1, d, self.hk, self.d), k=kd.view(1, d, self.hk, self.d), v=vd.view(1, d, self.hv, self.d),
                initial_state=ssm_state, inplace_final_state=True, cu_seqlens=m.non_spec_query_start_loc[: split + 1],
                ssm_state_indices=m.non_spec_state_indices_tensor, use_qk_l2norm_in_kernel=True,
            )  # fmt: skip
            outs.append(out_d)
        initial_state = ssm_state[m.prefill_state_indices]
        initial_state[~m.prefill_has_initial_state, ...] = 0
        out, last = self.ops.chunk_gated_delta_rule(
            q=q.unsqueeze(0), k=k.unsqueeze(0), v=v.unsqueeze(0), g=g.unsqueeze(0), beta=beta.unsqueeze(0),
            initial_state=initial_state, output_final_state=True, cu_seqlens=m.prefill_query_start_loc,
            chunk_indices=m.chunk_indices, chunk_offsets=m.chunk_offsets, use_qk_l2norm_in_kernel=False,
        )  # fmt: skip
        ssm_state[m.prefill_state_indices] = last.to(ssm_state.dtype)
        return torch.cat([*outs, out], dim=1)

    def compare(self, out, ref, query) -> dict:
        rows, tokens = self.split
        decode_blocks = torch.arange(1, rows + 1, device=out.device)  # RunnerBuffers: request i in block i + 1
        other_blocks = torch.arange(rows + 1, self.ref_cache[1].shape[0], device=out.device)
        (conv_r, ssm_r), (conv_g, ssm_g) = self.ref_cache, self.graph_cache
        verdict = {
            "output": torch.equal(out[:, tokens : ref.shape[1]], ref[:, tokens:]),
            "states": torch.equal(conv_r[1:], conv_g[1:]) and torch.equal(ssm_r[other_blocks], ssm_g[other_blocks]),
        }
        if rows:
            diff_out = (out[:, :tokens].float() - ref[:, :tokens].float()).abs().max().item()
            diff_state = (ssm_r[decode_blocks] - ssm_g[decode_blocks]).abs().max().item()
            verdict["decode_max_abs"] = (diff_out, diff_state)
            # the next batch starts both histories from the same decode states again
            ssm_g[decode_blocks] = ssm_r[decode_blocks]
        return verdict

    def mixed(self, inputs, cache):
        from chunkmeta.integrations.vllm.mixed_step import gdn_mixed_forward

        x = self.static
        return gdn_mixed_forward(
            self.ops, inputs, mixed_qkv=x["mixed_qkv"], a=x["a"], b=x["b"], conv_weight=self.conv_weight,
            conv_bias=None, activation="silu", conv_state=cache[0], ssm_state=cache[1], A_log=self.A_log,
            dt_bias=self.dt_bias, num_k_heads=self.hk, head_k_dim=self.d, head_v_dim=self.d,
        )  # fmt: skip


def run_exact(bench: Bench, case, requests: int, tokens: int, batches: int, seed: int) -> dict:
    """``batches`` random batches of at most ``requests`` rows and ``tokens`` tokens through vLLM's
    eager path (exact shapes, the stock builder's metadata) and ``case.mixed`` on a bucket of
    ``tokens`` x ``request_bucket(requests)`` (padded request rows in every batch): captured
    once and replayed on CUDA (staging and replay under ``set_sync_debug_mode("error")``), run
    eagerly on CPU. Compared bit for bit: every real token's output, every real block's states."""
    from chunkmeta.integrations.vllm.mixed_step import MixedStepInputs

    dev, cuda = bench.device, bench.device.type == "cuda"
    inputs = MixedStepInputs(tokens, request_bucket(requests), dev)
    gen = torch.Generator(device=dev).manual_seed(seed)
    rng = np.random.default_rng(seed)
    graph, out_static, capture_s, pool_bytes = None, None, None, None
    if cuda:  # capture on a first batch (warm-up outside: Triton compiles and tunes there)
        stage(inputs, bench.engine.inputs.common_metadata(*case.batch(rng, requests, tokens)))
        case.mixed(inputs, tuple(torch.zeros_like(t) for t in case.graph_cache))
        torch.cuda.synchronize()
        graph, before = torch.cuda.CUDAGraph(), torch.cuda.memory_reserved()
        start = time.perf_counter()
        with torch.cuda.graph(graph):
            out_static = case.mixed(inputs, case.graph_cache)
        capture_s, pool_bytes = time.perf_counter() - start, torch.cuda.memory_reserved() - before
        torch.cuda.synchronize()
    for t in (*case.ref_cache, *case.graph_cache):
        t.zero_()  # both histories start alike
    mismatches, tokens_compared, decode_max = [], 0, [0.0, 0.0]
    router = bench.kda_ops.router
    hits, misses = router.hits, router.misses
    for b in range(batches):
        query, context = case.batch(rng, int(rng.integers(2, requests + 1)), tokens)
        for t in case.static.values():
            t.copy_(torch.randn(t.shape, generator=gen, device=dev).to(t.dtype))
        m = bench.engine.inputs.common_metadata(query, context)
        ref = case.eager(bench.builders["vllm_piecewise"].build(0, m))
        if cuda:
            torch.cuda.set_sync_debug_mode("error")  # staging and replay: no sync
            try:
                stage(inputs, m)
                graph.replay()
            finally:
                torch.cuda.set_sync_debug_mode("default")
            out = out_static
        else:
            stage(inputs, m)
            out = case.mixed(inputs, case.graph_cache)
        n = m.num_actual_tokens
        if hasattr(case, "compare"):
            verdict = case.compare(out, ref, query)
        else:
            verdict = {
                "output": torch.equal(out[:, :n], ref),
                "states": all(torch.equal(x[1:], y[1:]) for x, y in zip(case.ref_cache, case.graph_cache, strict=True)),
            }
        if "decode_max_abs" in verdict:
            decode_max = [max(a, b) for a, b in zip(decode_max, verdict["decode_max_abs"], strict=True)]
        tokens_compared += n
        if not (verdict["output"] and verdict["states"]):
            mismatches.append({"batch": b, "query_lens": query, "context_lens": context, **verdict})
    return {
        "layer": case.name, "requests": requests, "tokens": tokens, "request_bucket": request_bucket(requests),
        "batches": batches, "tokens_compared": tokens_compared, "bit_identical": not mismatches,
        "mismatches": mismatches[:5], "captured": graph is not None, "capture_s": capture_s,
        # calls of the vendored prepare_chunk_* answered with the bucket's tables (eager runs only:
        # a replay runs no Python); the stock path's own calls fall through uncounted
        "router_hits_per_batch": (router.hits - hits) / batches,
        # calls with the bucket's cu_seqlens at a chunk size it has no table for: FLA derives
        # that one itself, with its sync (a capture fails there)
        "router_misses": router.misses - misses,
        # gdn_with_decodes: the decode rows' largest |difference| (outputs, recurrent states)
        "decode_max_abs_output": decode_max[0], "decode_max_abs_state": decode_max[1],
        "graph_pool_bytes": pool_bytes,
    }  # fmt: skip


# -- steps: the whole step, three methods -------------------------------------------------------


class Piecewise:
    """The GEMM pieces of a step for one token bucket, as vLLM's piecewise graphs hold them:
    ``pre[l]`` (input GEMMs of layer l) and ``post[l]`` (``o_proj``), each segment between two
    linear-attention ops one graph; the linear-attention ops run eagerly between replays."""

    def __init__(self, bench: Bench, tokens: int, capture: bool):
        s, dev = bench.shape, bench.device
        self.bench, self.tokens = bench, tokens
        self.h = torch.zeros(tokens, s.hidden, dtype=s.dtype, device=dev)
        self.o = torch.zeros(tokens, s.proj, dtype=s.dtype, device=dev)
        self.proj = [None] * s.layers
        self.segments = []
        for i in range(s.layers + 1):
            self.segments.append(self._segment(i, capture))

    def _pre(self, i):
        self.proj[i] = loop.project(self.bench.shape, self.h, self.bench.engine.layers[i])

    def _post(self, i):
        self.h.copy_(F.linear(self.o, self.bench.engine.layers[i].o_proj))

    def _segment(self, i, capture):
        layers = self.bench.shape.layers

        def run():
            if i > 0:
                self._post(i - 1)
            if i < layers:
                self._pre(i)

        if not capture:
            return run
        run()  # warm-up
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        return graph.replay

    def step(self, x, attention) -> torch.Tensor:
        """``attention(i, mixed_qkv, g1, beta)`` -> the real tokens' output ``[1, n, H, D]``."""
        n = x.shape[0]
        self.h[:n].copy_(x)
        for i, segment in enumerate(self.segments):
            segment()
            if i < len(self.proj):
                out = attention(i, *self.proj[i])
                self.o[:n].copy_(out.reshape(n, -1))
        return self.h


class FullStep:
    """The whole step of one bucket (tokens x requests) in one graph: GEMMs and the graph-safe
    linear-attention forward of every layer; ``stage()`` then replay per step."""

    def __init__(self, bench: Bench, method: str, tokens: int, requests: int, capture: bool):
        from chunkmeta.integrations.vllm.mixed_step import MixedStepInputs

        s, dev = bench.shape, bench.device
        self.bench, self.method, self.tokens = bench, method, tokens
        self.inputs = MixedStepInputs(tokens, requests, dev)
        self.h = torch.zeros(tokens, s.hidden, dtype=s.dtype, device=dev)
        self.capture_s = self.pool_bytes = None
        self.graph = None
        if capture:
            stage(self.inputs, bench.engine.inputs.common_metadata([tokens // requests] * requests, [0] * requests))
            scratch = [tuple(torch.zeros_like(t) for t in c) for c in bench.engine.caches[method]]
            self._run(scratch)  # warm-up on scratch states: the capture runs nothing
            torch.cuda.synchronize()
            graph, before = torch.cuda.CUDAGraph(), torch.cuda.memory_reserved()
            start = time.perf_counter()
            with torch.cuda.graph(graph):
                self.out = self._run(bench.engine.caches[method])
            self.capture_s, self.pool_bytes = time.perf_counter() - start, torch.cuda.memory_reserved() - before
            self.graph = graph

    def _run(self, caches):
        b, s = self.bench, self.bench.shape
        h = self.h
        for w, cache in zip(b.engine.layers, caches, strict=True):
            o = linear_attention_mixed(b, self.inputs, *loop.project(s, h, w), w, cache)
            h = F.linear(o.reshape(self.tokens, s.proj), w.o_proj)
        return h

    def step(self, m, x) -> torch.Tensor:
        stage(self.inputs, m)
        self.h[: x.shape[0]].copy_(x)
        if self.graph is None:
            return self._run(self.bench.engine.caches[self.method])
        self.graph.replay()
        return self.out


def run_steps(bench: Bench, requests: int, tokens: int, steps: int, seed: int, capture: bool) -> dict:
    dev = bench.device
    cuda = dev.type == "cuda"
    rng = np.random.default_rng(seed)
    for caches in bench.engine.caches.values():  # every method starts from the same (zero) states
        for cache in caches:
            for t in cache:
                t.zero_()
    row = {"requests": requests, "tokens": tokens, "request_bucket": request_bucket(requests)}
    piecewise = Piecewise(bench, tokens, capture)
    full = FullStep(bench, "chunkmeta_full", tokens, request_bucket(requests), capture)
    row["chunkmeta_full_capture_s"], row["chunkmeta_full_graph_bytes"] = full.capture_s, full.pool_bytes
    batch = {}
    last = {}

    def next_batch():
        batch["case"] = random_batch(rng, requests, tokens)

    def run(method):
        query, context = batch["case"]
        m = bench.engine.inputs.common_metadata(query, context)
        x = bench.engine.x[: m.num_actual_tokens]
        if method == "chunkmeta_full":
            last[method] = full.step(m, x)[: m.num_actual_tokens]
            return
        metadata = bench.builders[method].build(0, m)
        caches = bench.engine.caches[method]

        def attention(i, mixed_qkv, g1, beta):
            return linear_attention_eager(bench, metadata, mixed_qkv, g1, beta, bench.engine.layers[i], caches[i])

        last[method] = piecewise.step(x, attention)[: m.num_actual_tokens]

    wait = torch.cuda.current_stream().synchronize if cuda else (lambda: None)
    syncs = {}
    next_batch()
    for method in METHODS:  # warm-up, and the sync count of one step each
        run(method)
        wait()
        if cuda:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    run(method)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            wait()
            syncs[method] = sum(loop.TORCH_SYNC_WARNING in str(w.message) for w in caught)
    calls = [0]

    def timed(method):
        if calls[0] % len(METHODS) == 0:
            next_batch()  # a new batch every round, the same for every method (whatever the order)
        calls[0] += 1
        run(method)

    times = interleaved_ms(timed, list(METHODS), steps, wait=wait)
    next_batch()  # one more step each, untimed: outputs compared (the static buffers are reused)
    final = {}
    for method in METHODS:
        run(method)
        final[method] = last[method].clone()
    row["last_output_equal"] = torch.equal(final["vllm_piecewise"], final["chunkmeta_full"])
    row["piecewise_output_equal"] = torch.equal(final["vllm_piecewise"], final["chunkmeta_piecewise"])
    row["finite_output"] = bool(torch.isfinite(final["vllm_piecewise"]).all())
    row["states_equal"] = bench.states_equal("vllm_piecewise", "chunkmeta_full")
    row["piecewise_states_equal"] = bench.states_equal("vllm_piecewise", "chunkmeta_piecewise")
    for method in METHODS:
        row[method] = {"ms_per_step": median(times[method]), "syncs_per_step": syncs.get(method)}
    base = row["vllm_piecewise"]["ms_per_step"]
    row["speedup_full"] = base / row["chunkmeta_full"]["ms_per_step"]
    row["speedup_piecewise"] = base / row["chunkmeta_piecewise"]["ms_per_step"]
    if cuda:  # after the comparisons: these steps move chunkmeta_full's states alone
        row["chunkmeta_full_kernel_ms"] = device_ms(lambda: run("chunkmeta_full"), wait)
        row["chunkmeta_full_over_kernels"] = row["chunkmeta_full"]["ms_per_step"] / row["chunkmeta_full_kernel_ms"]
    return row


# -- decode: decode-only steps, vLLM's FULL decode graph against the bucket's graph ---------------


class DecodeStep:
    """vLLM's FULL decode graph of the step (FULL_AND_PIECEWISE's decode routine, which a mixed
    FULL mode gives up: decode-only batches then replay their bucket's mixed graph): per layer the
    input GEMMs, Kimi's pure-decode path (kimi_gdn_linear_attn.py:595-627: ``causal_conv1d_update``
    over the packed q/k/v, ``fused_recurrent_kda_packed_decode`` on the recurrent state in place)
    and ``o_proj``, for ``requests`` one-token rows, captured once."""

    def __init__(self, bench: Bench, method: str, requests: int, capture: bool):
        s, dev = bench.shape, bench.device
        self.bench, self.method, self.requests = bench, method, requests
        self.h = torch.zeros(requests, s.hidden, dtype=s.dtype, device=dev)
        self.indices = torch.zeros(requests, dtype=torch.int32, device=dev)  # the builder's persistent buffer
        self.graph = None
        if capture:
            self.indices.copy_(torch.arange(1, requests + 1, dtype=torch.int32, device=dev))
            self._run([tuple(torch.zeros_like(t) for t in c) for c in bench.engine.caches[method]])  # warm-up
            torch.cuda.synchronize()
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.out = self._run(bench.engine.caches[method])

    def _run(self, caches):
        b, s = self.bench, self.bench.shape
        h = self.h
        for w, (conv_state, recurrent_state) in zip(b.engine.layers, caches, strict=True):
            mixed_qkv, g1, beta = loop.project(s, h, w)
            if not b.ops.conv_dim_first:
                conv_state = conv_state.transpose(-1, -2)
            weights = w.conv1d.view(w.conv1d.size(0), w.conv1d.size(2))
            conv_out = b.ops.causal_conv1d_update(
                mixed_qkv, conv_state, weights, None, activation="silu", conv_state_indices=self.indices,
                validate_data=True, out=torch.empty(mixed_qkv.shape, dtype=mixed_qkv.dtype, device=mixed_qkv.device),
            )  # fmt: skip
            o, _ = b.ops.fused_recurrent_kda_packed_decode(
                mixed_qkv=conv_out, raw_g=g1, raw_beta=beta, A_log=w.A_log, dt_bias=w.dt_bias, lower_bound=None,
                initial_state=recurrent_state, state_indices=self.indices,
            )  # fmt: skip
            h = F.linear(o.reshape(self.requests, s.proj), w.o_proj)
        return h

    def step(self, m, x) -> torch.Tensor:
        self.indices.copy_(m.block_table_tensor[:, 0], non_blocking=True)
        self.h.copy_(x)
        if self.graph is None:
            return self._run(self.bench.engine.caches[self.method])
        self.graph.replay()
        return self.out


DECODE_METHODS = ("vllm_full_decode", "chunkmeta_full")


def run_decode(bench: Bench, requests: int, steps: int, seed: int, capture: bool) -> dict:
    """Decode-only steps of ``requests`` rows (new contexts every step), both methods from the same
    random states: ms/step, their ratio, the GPU's own time of each, and how far apart the two
    kernels' outputs and states end (not bit for bit: other arithmetic)."""
    dev = bench.device
    cuda = dev.type == "cuda"
    gen = torch.Generator(device=dev).manual_seed(seed)
    caches = {
        "vllm_full_decode": bench.engine.caches["vllm_piecewise"],
        "chunkmeta_full": bench.engine.caches["chunkmeta_full"],
    }
    for a, b in zip(caches["vllm_full_decode"], caches["chunkmeta_full"], strict=True):
        for x, y in zip(a, b, strict=True):  # a prefilled history, the same for both
            x.copy_((torch.randn(x.shape, generator=gen, device=dev) * 0.1).to(x.dtype))
            y.copy_(x)
    steppers = {
        "vllm_full_decode": DecodeStep(bench, "vllm_piecewise", requests, capture),
        "chunkmeta_full": FullStep(bench, "chunkmeta_full", requests, requests, capture),
    }
    rng = np.random.default_rng(seed)
    batch, last = {}, {}

    def run(method):
        m = bench.engine.inputs.common_metadata([1] * requests, batch["context"])
        last[method] = steppers[method].step(m, bench.engine.x[:requests])

    calls = [0]

    def timed(method):
        if calls[0] % len(DECODE_METHODS) == 0:
            batch["context"] = [int(c) for c in rng.integers(16, 4000, size=requests)]
        calls[0] += 1
        run(method)

    wait = torch.cuda.current_stream().synchronize if cuda else (lambda: None)
    times = interleaved_ms(timed, list(DECODE_METHODS), steps, wait=wait)
    ref, got = (last[m].float() for m in DECODE_METHODS)
    pairs = [
        (x, y) for p, q in zip(*caches.values(), strict=True) for x, y in zip(p, q, strict=True)
    ]  # fmt: skip
    row = {
        "requests": requests,
        "max_abs_output": (ref - got).abs().max().item(),
        "max_abs_state": max((x[1:].float() - y[1:].float()).abs().max().item() for x, y in pairs),
        "finite": bool(torch.isfinite(got).all()),
    }
    for method in DECODE_METHODS:
        row[method] = {"ms_per_step": median(times[method])}
        if cuda:
            row[method]["device_ms"] = device_ms(lambda method=method: run(method), wait)
    row["chunkmeta_over_vllm"] = row["chunkmeta_full"]["ms_per_step"] / row["vllm_full_decode"]["ms_per_step"]
    return row


# issue 34's targets: chunkmeta_full against vllm_piecewise per (requests, tokens)
TARGET_SPEEDUPS = {(8, 256): 3.0, (8, 1024): 3.0, (8, 4096): 1.5}


def targets(rows: list[dict]) -> dict:
    """Whether each speed-up target is met, never slower anywhere, within 10% of its kernels."""
    done = [r for r in rows if "speedup_full" in r]
    per_shape = {
        f"{r['requests']}x{r['tokens']}": r["speedup_full"] >= TARGET_SPEEDUPS[(r["requests"], r["tokens"])]
        for r in done
        if (r["requests"], r["tokens"]) in TARGET_SPEEDUPS
    }
    over = [r["chunkmeta_full_over_kernels"] for r in done if "chunkmeta_full_over_kernels" in r]
    return {
        "speedups_met": per_shape,
        "never_slower": None if not done else min(r["speedup_full"] for r in done) >= 1.0,
        "within_10pct_of_kernels": None if not over else max(over) <= 1.10,
        "bit_identical_states": None if not done else all(r["states_equal"] for r in done),
    }


def device_ms(step, wait, repeats: int = 3) -> float:
    """The GPU's own time in one ``step`` (torch.profiler: every kernel, copy and fill, graph
    replays included), the mean of ``repeats``: what a step that is not host-bound takes."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    wait()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            step()
        wait()
    total_us = sum(e.device_time for e in prof.events() if e.device_type == DeviceType.CUDA)
    return total_us / 1e3 / repeats


def format_tables(figures: dict, device: str) -> str:
    lines = [f"# vLLM mixed step in one CUDA graph: {device}, {figures['model']}", "", "## exact", ""]
    for e in figures["exact"]:
        if "error" in e:
            lines.append(f"{e['layer']}: failed: {e['error'].splitlines()[0][:160]}")
            continue
        how = "captured once, replayed" if e["captured"] else "eager (no CUDA)"
        same = "yes" if e["bit_identical"] else "NO"
        tolerance = ""
        if e["layer"] == "gdn_with_decodes":
            tolerance = (
                f"; decode rows (vLLM's recurrent kernel) differ by up to {e['decode_max_abs_output']:.3g} in the "
                f"output, {e['decode_max_abs_state']:.3g} in the state"
            )
        lines.append(
            f"{e['layer']}: {e['batches']} random batches (up to {e['requests']} requests, {e['tokens']} tokens; "
            f"bucket {e['request_bucket']} x {e['tokens']}), {how}: bit-identical to vLLM's eager path: {same} "
            f"({e['tokens_compared']} tokens){tolerance}"
        )
    lines += [
        "",
        "## steps",
        "",
        "| requests x tokens | vllm_piecewise ms | chunkmeta_piecewise ms | chunkmeta_full ms | full speed-up | "
        "full / its kernels | syncs (vllm / cm pw / cm full) | capture s | graph MiB | outputs / states equal |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in figures["steps"]:
        if "error" in r:
            lines.append(f"| {r['requests']} x {r['tokens']} | failed: {r['error'][:80]} |")
            continue
        syncs = " / ".join("n/a" if r[m]["syncs_per_step"] is None else str(r[m]["syncs_per_step"]) for m in METHODS)
        mib = "n/a" if r["chunkmeta_full_graph_bytes"] is None else f"{r['chunkmeta_full_graph_bytes'] / 2**20:.0f}"
        cap = "n/a" if r["chunkmeta_full_capture_s"] is None else f"{r['chunkmeta_full_capture_s']:.2f}"
        over = f"{r['chunkmeta_full_over_kernels']:.2f}x" if "chunkmeta_full_over_kernels" in r else "n/a"
        lines.append(
            f"| {r['requests']} x {r['tokens']} | {r['vllm_piecewise']['ms_per_step']:.3f} | "
            f"{r['chunkmeta_piecewise']['ms_per_step']:.3f} | {r['chunkmeta_full']['ms_per_step']:.3f} | "
            f"{r['speedup_full']:.2f}x | {over} | {syncs} | {cap} | {mib} | "
            f"{r['last_output_equal']} / {r['states_equal']} |"
        )
    lines += ["", "## decode-only steps", "", "| requests | vLLM FULL decode ms | chunkmeta_full ms | ratio | "
              "device ms (vLLM / chunkmeta) | max abs output / state |", "|---|---|---|---|---|---|"]  # fmt: skip
    for r in figures.get("decode", []):
        if "error" in r:
            lines.append(f"| {r['requests']} | failed: {r['error'].splitlines()[0][:80]} |")
            continue
        v, c = r["vllm_full_decode"], r["chunkmeta_full"]
        dev = f"{v['device_ms']:.3f} / {c['device_ms']:.3f}" if "device_ms" in v else "n/a"
        lines.append(
            f"| {r['requests']} | {v['ms_per_step']:.3f} | {c['ms_per_step']:.3f} | {r['chunkmeta_over_vllm']:.2f}x | "
            f"{dev} | {r['max_abs_output']:.3g} / {r['max_abs_state']:.3g} |"
        )
    t = figures.get("targets")
    lines += ["", f"targets (issue 34): {t}" if t else "targets (issue 34): not judged (CPU smoke run)"]
    return "\n".join(lines)


DEFAULTS = dict(
    steps=30,
    layers=24,
    heads=16,
    head_dim=128,
    hidden=2304,
    exact_batches=200,
    exact_shapes="8x256,32x512",
    shapes="8x256,8x1024,8x4096,32x512,64x4096",
    decode_shapes="8,64",
)
SMOKE_DEFAULTS = dict(
    steps=2,
    layers=1,
    heads=2,
    head_dim=16,
    hidden=32,
    exact_batches=4,
    exact_shapes="4x16",
    shapes="4x16",
    decode_shapes="4",
)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    for name in DEFAULTS:
        parser.add_argument(f"--{name.replace('_', '-')}", type=str if name.endswith("shapes") else int)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    for name, value in (SMOKE_DEFAULTS if args.smoke else DEFAULTS).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    started = time.monotonic()
    vllm_builders.import_vllm()
    if args.smoke:
        loop.check_smoke_environment()
    elif not torch.cuda.is_available():
        sys.exit("no CUDA device: vLLM's ops need one (or Triton's interpreter: --smoke)")
    device = torch.device("cpu" if args.smoke else "cuda")
    shape = loop.Shape(
        hidden=args.hidden, heads=args.heads, head_dim=args.head_dim, conv_kernel=4, layers=args.layers,
        dtype=torch.float32 if args.smoke else torch.bfloat16,
    )  # fmt: skip

    def parse(text):
        return [tuple(int(v) for v in shape.split("x")) for shape in text.split(",")]

    shapes, exact_shapes = parse(args.shapes), parse(args.exact_shapes)
    max_reqs = max(request_bucket(r) for r, _ in shapes + exact_shapes)
    max_tokens = max(t for _, t in shapes + exact_shapes)
    with tempfile.TemporaryDirectory() as root:
        config = vllm_builders.configs(root, max_num_seqs=max_reqs, max_num_tokens=max_tokens, prefix_caching=False)[
            "gdn"
        ]
    made, errors = loop.make_builders("gdn", config, shape, device)
    if errors:
        sys.exit(f"builders: {errors}")
    builders = {"vllm_piecewise": made["vllm"], "chunkmeta_piecewise": made["chunkmeta"]}
    bench = Bench(shape, builders, loop.Ops(device), max_reqs, max_tokens, device, METHODS)
    figures = {"model": shape.describe(), "smoke": args.smoke, "steps_per_shape": args.steps}
    figures["exact"] = []
    for requests, tokens in exact_shapes:
        blocks = max_reqs + 1
        for case in (KdaCase(bench, tokens), GdnCase(bench, tokens, blocks), GdnCase(bench, tokens, blocks, True)):
            try:
                figures["exact"].append(run_exact(bench, case, requests, tokens, args.exact_batches, args.seed))
            except Exception as exc:  # noqa: BLE001  (the other layers and the steps go on)
                figures["exact"].append({"layer": case.name, "error": loop._error(exc), "bit_identical": False})
            verdict = figures["exact"][-1]["bit_identical"]
            print(f"[{time.monotonic() - started:6.1f} s] exact {case.name} {requests}x{tokens}: {verdict}", flush=True)
    figures["steps"] = []
    for requests, tokens in shapes:
        try:
            figures["steps"].append(run_steps(bench, requests, tokens, args.steps, args.seed, capture=not args.smoke))
        except Exception as exc:  # noqa: BLE001  (the next shapes go on)
            figures["steps"].append({"requests": requests, "tokens": tokens, "error": loop._error(exc)})
        print(f"[{time.monotonic() - started:6.1f} s] {requests} x {tokens} done", flush=True)
    figures["decode"] = []
    for requests in (int(r) for r in args.decode_shapes.split(",")):
        try:
            figures["decode"].append(run_decode(bench, requests, args.steps, args.seed, capture=not args.smoke))
        except Exception as exc:  # noqa: BLE001
            figures["decode"].append({"requests": requests, "error": loop._error(exc)})
        print(f"[{time.monotonic() - started:6.1f} s] decode {requests} done", flush=True)
    figures["targets"] = None if args.smoke else targets(figures["steps"])  # the interpreter's times say nothing
    figures["seconds"] = round(time.monotonic() - started, 1)
    record = runs.save("vllm_full_graph", figures, script="bench/vllm_full_graph.py", argv=argv, out=args.out)
    print(format_tables(figures, record["device"].get("gpu", "cpu")))
    ok = all(e["bit_identical"] for e in figures["exact"]) and all(r.get("states_equal") for r in figures["steps"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
