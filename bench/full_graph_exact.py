"""bench/vllm_full_graph.py's exact part: one layer's linear-attention part (Kimi-Linear's KDA,
Qwen3-Next's GDN) through vLLM's eager path and through the graph-safe forward on a bucket,
compared bit for bit (GDN's decode rows: by their largest difference)."""

from __future__ import annotations

import numpy as np
import torch
from full_graph_common import (
    Bench,
    blocks_equal,
    capture,
    linear_attention_eager,
    linear_attention_mixed,
    random_batch,
    request_bucket,
    stage,
)


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


def run_exact(bench: Bench, case, requests: int, tokens: int, batches: int, seed: int, mode: str) -> dict:
    """``batches`` random batches of at most ``requests`` rows and ``tokens`` tokens through vLLM's
    eager path (exact shapes, the stock builder's metadata) and ``case.mixed`` on a bucket of
    ``tokens`` x ``request_bucket(requests)`` (padded request rows in every batch): captured
    once and replayed (``mode``: ``full_graph_common.capture``; on CUDA staging and replay under
    ``set_sync_debug_mode("error")``), or run eagerly (``"off"``). Compared bit for bit: every real
    token's output, every real block's states."""
    from chunkmeta.integrations.vllm.full_graph import bucket_levels
    from chunkmeta.integrations.vllm.mixed_step import MixedStepInputs, SharedFill

    dev, cuda = bench.device, bench.device.type == "cuda"
    rows = request_bucket(requests)
    # as in the engine, the bucket views the tables of a larger one's fill (the largest capture
    # size's): its padding rows point past its own rows
    fill = SharedFill(4 * tokens, 4 * rows)
    inputs = MixedStepInputs(tokens, rows, dev, levels=bucket_levels(dev), fill=fill)
    gen = torch.Generator(device=dev).manual_seed(seed)
    rng = np.random.default_rng(seed)
    captured = None
    if mode != "off":  # capture on a first batch, after a warm-up on scratch states
        stage(inputs, bench.engine.inputs.common_metadata(*case.batch(rng, requests, tokens)))
        case.mixed(inputs, tuple(torch.zeros_like(t) for t in case.graph_cache))
        captured = capture(lambda: case.mixed(inputs, case.graph_cache), mode)
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
            if captured is not None:
                captured.replay()
                out = captured.out
            else:
                out = case.mixed(inputs, case.graph_cache)
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode("default")
        n = m.num_actual_tokens
        if hasattr(case, "compare"):
            verdict = case.compare(out, ref, query)
        else:
            verdict = {
                "output": torch.equal(out[:, :n], ref),
                "states": blocks_equal([case.ref_cache], [case.graph_cache]),
            }
        if "decode_max_abs" in verdict:
            decode_max = [max(a, b) for a, b in zip(decode_max, verdict["decode_max_abs"], strict=True)]
        tokens_compared += n
        if not (verdict["output"] and verdict["states"]):
            mismatches.append({"batch": b, "query_lens": query, "context_lens": context, **verdict})
    return {
        "layer": case.name, "requests": requests, "tokens": tokens, "request_bucket": request_bucket(requests),
        "batches": batches, "tokens_compared": tokens_compared, "bit_identical": not mismatches,
        "mismatches": mismatches[:5], "captured": mode, "capture_s": captured and captured.seconds,
        "segments": captured and captured.segments,  # "breakable": (graphs, eager breaks)
        # calls of the vendored prepare_chunk_* answered with the bucket's tables (eager runs only:
        # a replay runs no Python); the stock path's own calls fall through uncounted
        "router_hits_per_batch": (router.hits - hits) / batches,
        # calls with the bucket's cu_seqlens at a chunk size it has no table for: FLA derives
        # that one itself, with its sync (a capture fails there)
        "router_misses": router.misses - misses,
        # gdn_with_decodes: the decode rows' largest |difference| (outputs, recurrent states)
        "decode_max_abs_output": decode_max[0], "decode_max_abs_state": decode_max[1],
        "graph_pool_bytes": captured and captured.pool_bytes,
    }  # fmt: skip
