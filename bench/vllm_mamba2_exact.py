"""One Mamba2 layer (Nemotron-Nano-9B-v2's mixer sizes) through vLLM's eager path and through
chunkmeta's graph-safe mixed step, captured once in a CUDA graph and replayed: outputs and states
compared bit for bit (issue 49's exactness, on a GPU).

    python bench/vllm_mamba2_exact.py --out DIR [--batches 200] [--tokens 256] [--requests 8] [--timed 50]

Reference: vLLM 0.33.0's own ``MambaMixer2.conv_ssm_forward`` (the unpatched method, on the stock
``Mamba2AttentionMetadataBuilder``'s metadata of each batch at its exact shape). Ours: the
patched method on a chunkmeta builder's bucket of ``tokens`` x ``requests`` (every batch padded
to it as vLLM's FULL keys pad: zero-length rows on the null block), the step staged by
``build()`` and replayed under ``torch.cuda.set_sync_debug_mode("error")``. Both start every
batch from the same conv and SSM states. Random batches: decodes, prefill chunks with and
without a cached prefix. Mamba cache mode "none" (``--no-enable-prefix-caching``). The last
``timed`` batches also time one layer's step on each side (a one-layer harness figure: what a
bucket's padded rows and chunks cost against vLLM's host work, not a serving figure). Writes a
``vllm_mamba2_exact`` record under DIR (``bench/results.py``); prints the figures and each
mismatch. Needs CUDA and vLLM.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import types

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "integrations", "vllm"))

# Nemotron-Nano-9B-v2's mixer (bench/engine_models/nemotron_h/config.json)
HEADS, HEAD_DIM, GROUPS, STATE, CONV, CHUNK = 128, 80, 8, 128, 4, 128
LAYER = "model.layers.0.mixer"


def make_config(root: str, requests: int, tokens: int):
    from vllm.config import CacheConfig, VllmConfig
    from vllm.config.compilation import CUDAGraphMode

    from vllm_real_batches import model_config, scheduler_config, tiny_mamba2

    hf_config = tiny_mamba2(CHUNK)
    hf_config.architectures = ["Mamba2ForCausalLM"]  # a MambaMixer2 model, as a checkpoint names it
    model = model_config(hf_config, os.path.join(root, "mamba2"), max_model_len=32768)
    scheduler = scheduler_config(max(requests, 8), max(tokens, 2048), max_model_len=32768)
    config = VllmConfig(
        model_config=model, scheduler_config=scheduler, cache_config=CacheConfig(enable_prefix_caching=False)
    )
    config.compilation_config.cudagraph_mode = CUDAGraphMode.FULL
    return config


def make_layer(config, blocks: int, device, seed: int):
    """What ``conv_ssm_forward`` reads of a ``MambaMixer2`` (no tensor parallelism), with random
    weights, and its own conv (bfloat16) and SSM (float32) state caches."""
    gen = torch.Generator(device=device).manual_seed(seed)
    inner, bc = HEADS * HEAD_DIM, GROUPS * STATE
    conv_dim = inner + 2 * bc

    def randn(*shape, scale=1.0, dtype=torch.float32):
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(dtype)

    return types.SimpleNamespace(
        prefix=LAYER, cache_config=config.cache_config, mamba_config=config.mamba_config, num_spec=0,
        use_replayssm=False, tp_size=1, num_heads=HEADS, head_dim=HEAD_DIM, n_groups=GROUPS, ssm_state_size=STATE,
        conv_kernel_size=CONV, activation="silu", is_blackwell=False, tped_intermediate_size=inner,
        tped_conv_size=conv_dim, tped_dt_size=HEADS,
        split_hidden_states_B_C_fn=lambda t: torch.split(t, [inner, bc, bc], dim=-1),
        conv_weights=randn(conv_dim, CONV, scale=0.5, dtype=torch.bfloat16),
        conv1d=types.SimpleNamespace(bias=randn(conv_dim, scale=0.1, dtype=torch.bfloat16)),
        A=-torch.exp(randn(HEADS, scale=0.5)), D=randn(HEADS), dt_bias=randn(HEADS, scale=0.5),
        kv_cache=(conv_cache(blocks, conv_dim, device),
                  torch.zeros(blocks, HEADS, HEAD_DIM, STATE, dtype=torch.float32, device=device)),
    )  # fmt: skip


def conv_cache(blocks: int, conv_dim: int, device) -> torch.Tensor:
    """A conv state cache in vLLM's configured layout ("DS": (dim, width - 1) per block; "SD":
    transposed, which the layer transposes back)."""
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    shape = (blocks, conv_dim, CONV - 1) if is_conv_state_dim_first() else (blocks, CONV - 1, conv_dim)
    return torch.zeros(shape, dtype=torch.bfloat16, device=device)


def random_batch(rng, requests: int, tokens: int, max_prefills: int = 0):
    """``(query_lens, context_lens)``: decodes first (vLLM's order), then prefill chunks of at
    least two tokens, a fresh prompt or a later chunk over a cached prefix; at most
    ``max_prefills`` of them where it is not 0 (a bucket's SSD rows: vLLM dispatches a step of
    more to its own path)."""
    real = int(rng.integers(1, requests + 1))
    prefills = int(rng.integers(1, min(real, max_prefills or real) + 1))
    decodes = real - prefills
    budget = int(rng.integers(2 * prefills, tokens - decodes + 1))
    sizes = rng.multinomial(budget - 2 * prefills, [1 / prefills] * prefills) + 2
    query = [1] * decodes + [int(s) for s in sizes]
    context = [int(rng.integers(16, 4000)) for _ in range(decodes)]
    context += [0 if rng.random() < 0.4 else int(rng.integers(1, 8192)) for _ in sizes]
    return query, context


def on_blocks(m):
    """Request i's state in block i + 1 (Mamba cache mode "none" reads the first column), padding
    rows (zero-length) on the null block 0: one state block per request slot of the bucket."""
    real = (m.query_start_loc_cpu[1:] > m.query_start_loc_cpu[:-1]).to(m.block_table_tensor.device)
    rows = torch.arange(1, m.num_reqs + 1, dtype=m.block_table_tensor.dtype, device=m.block_table_tensor.device)
    m.block_table_tensor[:, 0] = torch.where(real, rows, 0)
    return m


def run(args, device=None) -> dict:
    """The comparison; ``device`` CPU (a dry run of the plumbing, with kernels a caller swapped
    in): every batch through the forward itself, no graph."""
    from vllm.forward_context import override_forward_context
    from vllm.model_executor.layers.mamba import mamba_mixer2
    from vllm.v1.attention.backends.mamba2_attn import Mamba2AttentionMetadataBuilder
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import MambaSpec

    from chunkmeta.integrations import vllm as adapter
    from chunkmeta.integrations.vllm import full_graph
    from vllm_real_batches import capture_metadata, common_metadata, full_padded_metadata

    device = device or torch.device("cuda")
    cuda = device.type == "cuda"
    eager_forward = mamba_mixer2.MambaMixer2.conv_ssm_forward  # vLLM's, before install() patches it
    os.environ[full_graph.FULL_GRAPH_ENV] = "1"
    os.environ[full_graph.MAMBA2_DECODES_ENV] = args.decodes  # read when install() patches the layer
    os.environ[full_graph.LEVELS_ENV] = str(getattr(args, "levels", 0))  # read per bucket
    ssd_rows = getattr(args, "ssd_rows", 0)
    os.environ[full_graph.MAMBA2_SSD_ROWS_ENV] = str(ssd_rows)
    if ssd_rows:  # a bucket of few SSD rows is Model Runner V2's (vLLM's default where Triton runs)
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    adapter.install(adapter.load_vllm_api())
    graph_forward = mamba_mixer2.MambaMixer2.__dict__["conv_ssm_forward"]
    assert graph_forward is not eager_forward, "install() did not patch MambaMixer2.conv_ssm_forward"
    spec = MambaSpec(block_size=16, shapes=((CONV - 1, 1), (1, 1, 1)), dtypes=(torch.bfloat16, torch.float32),
                     mamba_type=MambaAttentionBackendEnum.MAMBA2)  # fmt: skip
    config = make_config(tempfile.mkdtemp(prefix="mamba2_exact_"), args.requests, args.tokens)
    # the runner does this at start-up (v1/worker/gpu/model_runner.py:743): vLLM's Triton SSU
    from vllm.model_executor.layers.mamba.ops.ssu_dispatch import initialize_mamba_ssu_backend

    groups = types.SimpleNamespace(kv_cache_groups=[types.SimpleNamespace(kv_cache_spec=spec)])
    initialize_mamba_ssu_backend(config.mamba_config, groups)
    stock = Mamba2AttentionMetadataBuilder(spec, [LAYER], config, device)
    ours = adapter.chunkmeta_builder_class(Mamba2AttentionMetadataBuilder, reuse_block_table=True)(
        spec, [LAYER], config, device
    )
    blocks = args.requests + 1  # the null block 0, then request i's state in block i + 1
    ref, graph = make_layer(config, blocks, device, args.seed), make_layer(config, blocks, device, args.seed)
    in_dim = HEADS * HEAD_DIM + graph.tped_conv_size + HEADS
    projected = torch.zeros(args.tokens, in_dim, dtype=torch.bfloat16, device=device)
    output = torch.zeros(args.tokens, HEADS * HEAD_DIM, dtype=torch.bfloat16, device=device)
    rng, gen = np.random.default_rng(args.seed), torch.Generator(device=device).manual_seed(args.seed)

    def forward(layer, fn, metadata, x, out):
        with override_forward_context(types.SimpleNamespace(attn_metadata={LAYER: metadata})):
            fn(layer, x, out)

    bucket = ours.build_for_cudagraph_capture(capture_metadata(args.tokens, args.requests, device)).chunkmeta_mixed
    # warm-up (Triton compiles and autotunes) on a staged batch, then capture on the same inputs
    staged = ours.build(0, on_blocks(full_padded_metadata(*random_batch(rng, args.requests, args.tokens, ssd_rows),
                                                          args.requests, args.tokens, device)))  # fmt: skip
    assert staged.chunkmeta_mixed is bucket
    for _ in range(2):
        forward(graph, graph_forward, staged, projected, output)
    capture_s = pool_bytes = None
    eager = getattr(args, "eager", False) or not cuda  # the forward itself per batch, no graph
    if not eager:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # then what the capture reserves is the graph's own pool
        before = torch.cuda.memory_reserved()
        cuda_graph = torch.cuda.CUDAGraph()
        started = time.perf_counter()
        with torch.cuda.graph(cuda_graph, pool=torch.cuda.graph_pool_handle()):
            forward(graph, graph_forward, staged, projected, output)
        torch.cuda.synchronize()
        capture_s, pool_bytes = time.perf_counter() - started, torch.cuda.memory_reserved() - before
    verdicts = {"output_prefill": 0, "output_decode": 0, "conv_states": 0, "ssm_states": 0}
    decode_max, prefill_max, mismatches, decode_rows = 0.0, 0.0, [], 0
    timings = {"vllm_eager_us": [], "chunkmeta_graph_us": [], "vllm_forward_us": [], "chunkmeta_replay_us": []}
    for b in range(args.batches):
        query, context = random_batch(rng, args.requests, args.tokens, ssd_rows)
        n, d = sum(query), sum(1 for q, c in zip(query, context, strict=True) if q == 1 and c > 0)
        projected.copy_(torch.randn(projected.shape, generator=gen, device=device).to(projected.dtype))
        for r, g in zip(ref.kv_cache, graph.kv_cache, strict=True):
            r.copy_(torch.randn(r.shape, generator=gen, device=device).to(r.dtype))
            g.copy_(r)
        m = on_blocks(common_metadata(query, context, device))
        want_out = torch.zeros(n, HEADS * HEAD_DIM, dtype=torch.bfloat16, device=device)
        # vLLM's decode conv (causal_conv1d_update) writes its output over its input, the step's
        # projected states: the reference gets a copy, so both sides read the same inputs
        forward(ref, eager_forward, stock.build(0, m), projected[:n].clone(), want_out)
        padded = on_blocks(full_padded_metadata(query, context, args.requests, args.tokens, device))
        if not eager:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")  # staging and replay: no sync
            try:
                metadata = ours.build(0, padded)
                cuda_graph.replay()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        else:
            metadata = ours.build(0, padded)
            forward(graph, graph_forward, metadata, projected, output)
        assert metadata.chunkmeta_mixed is bucket
        got = output[:n]
        verdict = {
            "output_prefill": torch.equal(got[d:], want_out[d:]),
            "output_decode": torch.equal(got[:d], want_out[:d]),
            "conv_states": torch.equal(graph.kv_cache[0][1:], ref.kv_cache[0][1:]),
            "ssm_states": torch.equal(graph.kv_cache[1][1:], ref.kv_cache[1][1:]),
        }
        for key, ok in verdict.items():
            verdicts[key] += ok
        decode_rows += d
        if d:
            decode_max = max(decode_max, (got[:d].float() - want_out[:d].float()).abs().max().item())
        prefill_max = max(prefill_max, (got[d:].float() - want_out[d:].float()).abs().max().item())
        if not all(verdict.values()) and len(mismatches) < 5:
            differ = rows_differ(query, got, want_out, graph.kv_cache, ref.kv_cache)
            mismatches.append(
                {"batch": b, "query_lens": query, "context_lens": context, **verdict, "rows_differ": differ}
            )
        if not eager and b >= args.batches - args.timed:
            # one layer's step, each side synchronized: vLLM's build + eager forward against
            # chunkmeta's stage + replay (a one-layer harness figure, not an engine one)
            timings["vllm_eager_us"].append(_timed(lambda: forward(ref, eager_forward, stock.build(0, m),
                                                                   projected[:n], want_out)))  # fmt: skip
            timings["chunkmeta_graph_us"].append(_timed(lambda: (ours.build(0, padded), cuda_graph.replay())))
            # the layer alone: in a model the step's build is shared by every Mamba2 layer (27 in
            # Nemotron-Nano-9B-v2) and the forward is each layer's
            built = stock.build(0, m)
            timings["vllm_forward_us"].append(
                _timed(lambda: forward(ref, eager_forward, built, projected[:n], want_out))
            )
            timings["chunkmeta_replay_us"].append(_timed(cuda_graph.replay))
    return {
        "device": torch.cuda.get_device_name() if cuda else "cpu (dry run)", "batches": args.batches,
        "tokens": args.tokens, "requests": args.requests, "decode_rows": decode_rows, "identical_batches": verdicts,
        "max_abs_output_decode": decode_max, "max_abs_output_prefill": prefill_max, "mismatches": mismatches,
        "capture_s": capture_s, "graph_pool_bytes": pool_bytes, "staged_steps": ours.chunkmeta_mixed_steps,
        "mixed_fallbacks": ours.chunkmeta_stats()["mixed_fallbacks"], "decodes": args.decodes,
        "timed_batches": len(timings["vllm_eager_us"]), "levels": list(bucket.levels), "graph": not eager,
        "ssd_rows": bucket.ssd_rows,
        **{f"median_{k}": float(np.median(v)) for k, v in timings.items() if v},
    }  # fmt: skip


def rows_differ(query, got, want, states, want_states) -> dict:
    """The requests whose output rows, conv state or SSM state (block i + 1) differ, and by how much."""
    bounds = np.cumsum([0] + list(query))
    rows = [slice(bounds[i], bounds[i + 1]) for i in range(len(query))]
    diff = {"output": [i for i, r in enumerate(rows) if not torch.equal(got[r], want[r])]}
    for name, s, w in zip(("conv", "ssm"), states, want_states, strict=True):
        diff[name] = [i for i in range(len(query)) if not torch.equal(s[i + 1], w[i + 1])]
        diff[f"max_abs_{name}"] = (s[1:].float() - w[1:].float()).abs().max().item()
    return diff


def _timed(step) -> float:
    """Wall µs of one call, from an idle device to its work done."""
    from chunkmeta.timing import host_us

    torch.cuda.synchronize()
    return host_us(lambda: (step(), torch.cuda.synchronize()))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--levels", type=int, default=0, choices=(0, 1),
        help="1: the SSD in graph IF nodes per level of rows and chunks; 0: at the bucket's capacity (default)",
    )  # fmt: skip
    parser.add_argument("--eager", action="store_true", help="the forward eagerly per batch, no graph (a diagnostic)")
    parser.add_argument(
        "--ssd-rows", type=int, default=0,
        help="the bucket's SSD rows under Model Runner V2 (CHUNKMETA_VLLM_MAMBA2_SSD_ROWS; batches of at most as "
        "many prefills); 0: every row (default)",
    )  # fmt: skip
    parser.add_argument("--timed", type=int, default=50, help="the last TIMED batches are also timed, each side")
    parser.add_argument(
        "--decodes", default="ssu", choices=("ssu", "ssd"),
        help="decode rows through vLLM's SSU (default) or as one-token SSD rows (not vLLM's arithmetic)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("vllm_mamba2_exact: needs CUDA", file=sys.stderr)
        return 2
    # vLLM's CUDA platform: on its CPU platform (the bundle's default) the Mamba2 ops are the CPU
    # ones (ssd_combined.py:247), which the bundle lacks
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cuda")
    try:
        import vllm_bootstrap  # noqa: F401  the carried .vllm_bundle (docs/gpu.md)
    except ImportError:
        pass
    result = run(args)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import results as runs

    argv = sys.argv[1:] if argv is None else argv
    runs.save("vllm_mamba2_exact", result, script="bench/vllm_mamba2_exact.py", argv=argv, out=args.out)
    print(json.dumps({k: v for k, v in result.items() if k != "mismatches"}))
    for m in result["mismatches"]:
        print("mismatch", json.dumps(m))
    return 0 if not result["mismatches"] else 1


if __name__ == "__main__":
    sys.exit(main())
