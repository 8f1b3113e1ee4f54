"""vLLM 0.33.0's engine-like Kimi-Linear prefill step, vLLM's own metadata path against chunkmeta's (issue 19).

    python bench/vllm_step_loop.py --out DIR [--steps 50] [--layers 24] [--builder gdn|kimi_k3] [--budget-s S]
    python bench/vllm_step_loop.py --smoke --out DIR    (CPU, vLLM's ops under Triton's interpreter)

Prints the table below and writes its record (``bench/results.py``: ``vllm_step_loop.runs.jsonl``)
under ``--out``. On a GPU machine vLLM is an installed one or the carried ``.vllm_bundle``
(``source .vllm_bundle/setup_env.sh`` first; ``vllm_bootstrap`` is imported before vLLM).

Per step, as vLLM's GPU model runner runs a Kimi-Linear prefill step for one KV-cache group of
KDA layers:

1. the scheduler's inputs: ``query_start_loc``, ``seq_lens`` and the block table written on the
   host into pinned buffers and copied to the device without blocking, and a
   ``CommonAttentionMetadata`` over fresh views of them (``RunnerBuffers`` in
   ``tests/integrations/vllm/vllm_real_batches.py``);
2. the group's metadata builder's ``build()``, once for every layer of the group;
3. ``--layers`` layers, each as ``KimiGatedDeltaNetAttention.forward`` / ``_forward`` run a
   non-spec batch with prefills in vLLM 0.33.0 (``model_executor/layers/mamba/gdn/
   kimi_gdn_linear_attn.py``: ``forward`` 328-378, ``_forward`` 380-440 and 533-593): the input
   GEMM (``in_proj_qkvgfab`` -> mixed_qkv, beta, f_a) and ``f_b_proj`` (-> the raw gate g1); three
   ``causal_conv1d_fn`` calls on the strided q / k / v column slices with the metadata's conv
   tables (``metadata=``, ``has_initial_state``, ``cache_indices=non_spec_state_indices_tensor``,
   ``query_start_loc=non_spec_query_start_loc``) into the layer's conv state; vLLM's
   ``gather_initial_states``; the vendored ``chunk_kda_with_fused_gate`` (NVIDIA's copy, which
   Kimi-Linear imports off ROCm) with ``cu_seqlens=non_spec_query_start_loc`` only, exactly
   Kimi-Linear's arguments; the final states written back into the recurrent state; the output
   GEMM (``o_proj``). Decodes run in the same calls: with prefills in the batch, Kimi-Linear sends
   every non-spec row through the prefill path;
4. the end-of-step wait (``stream.synchronize()``: engines copy sampled tokens back once a step).

Methods, interleaved step by step (the order rotating each round: A B, B A, ...; medians of
``--steps``):

* ``vllm``       the stock builder (``GDNAttentionMetadataBuilder``, the Kimi-Linear layer's; or
                 ``KimiK3KDAMetadataBuilder``, NVIDIA, with ``--builder kimi_k3``): the conv tables on
                 the host with H2D copies; the FLA tables on the host too unless its prefill backend
                 is FlashInfer (vLLM's choice on Hopper), which Kimi-Linear does not read anyway; the
                 KDA op then derives its chunk tables itself in the first layer
                 (``prepare_chunk_indices``: ``.tolist()``, a sync);
* ``chunkmeta``  ``chunkmeta_builder_class`` of that builder, with ``install()`` done: one device
                 launch for the step's tables; the router hands them to the KDA op (no sync).

Each method has its own conv and recurrent states (every layer's), so both see the same history;
outputs are compared bit for bit (``torch.equal``): each method's last warm-up step's output, its
last timed step's, and every layer's states after the run. Syncs per step: one step of each under
``torch.cuda.set_sync_debug_mode("warn")`` (the end-of-step wait outside it), the warnings counted,
with the source lines they point at. The stock path runs with the router installed too (it falls
through on one identity check per helper call), as in a vLLM where chunkmeta is installed.

Shapes (the seed's): a 4096-token step (vLLM's ``max_num_batched_tokens``, the chunk size) at 8,
16, 32 and 64 concurrent requests, decodes first: concurrency c is c - 1 decodes (contexts
1000-3900 tokens) and one prefill chunk of 4096 - (c - 1) tokens with 8192 tokens already
prefilled (a later chunk of a long prompt); all rows have an initial state. Model: Kimi-Linear
48B-A3B's KDA layer (hidden 2304, head_dim 128, conv kernel 4) with 16 of its 32 heads (a
tensor-parallel-2 shard, the KDA shape of ``bench/step_loop.py``), bf16, 24 layers. Left out of the
layer: the low-rank output-gate GEMMs (``g_a_proj``, ``g_b_proj``), ``o_norm``, the all-reduce;
left out of the model: the MLA and MoE layers (another KV-cache group) and sampling. Everything
runs eager (vLLM runs this part of the layer eager too: ``eager_break_during_capture``).

``--smoke`` (CPU): 1 layer, 2 heads of 16, hidden 32, 16-token steps at 2 and 4 requests, float32
(the interpreter's bf16 ``tl.dot`` is not faithful), 1 warm-up and 2 timed steps, under
``TRITON_INTERPRET=1`` with ``tests/support/fla_interp.apply_vllm()``; it needs a ``triton`` on the
path (``.venv-vllm`` has none: ``tests/integrations/vllm/test_vllm_step_loop_smoke.py`` lends it the
repo's ``.venv`` one) and sets ``CUDA_VISIBLE_DEVICES=""`` (see ``fla_interp``). Kimi-Linear's
gate (no ``gate_lower_bound``) takes KDA's token-parallel intra-chunk kernel, one interpreted
program per token and head, hence the tiny steps. Its conv is vLLM's CPU platform's torch version
(the interpreter fails inside vLLM's Triton conv kernel), which reads no conv table: the GPU run
takes the Triton one. It shows that both paths run and agree; its times are the interpreter's, and
there are no syncs to count on CPU.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

SMOKE = "--smoke" in sys.argv[1:]
if SMOKE:  # before torch and triton are imported: the interpreter is chosen at import
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import results as runs  # noqa: E402  bench/results.py: the record format
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import vllm_builders  # noqa: E402  bench/vllm_builders.py: vLLM's import and configs

from chunkmeta.timing import interleaved_ms, median, percentile  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
for _support in ("tests/integrations/vllm", "tests/support"):
    sys.path.insert(0, str(ROOT / _support))

METHODS = ("vllm", "chunkmeta")
CONCURRENCY = (8, 16, 32, 64)
WARMUP_STEPS = 2  # per method: Triton compiles and autotunes here, outside timing
PREFILL_CONTEXT = 8192
MAX_NUM_SEQS = 256  # vLLM's default max_num_seqs: the builders' request capacity


class Shape:
    """A layer's sizes and the step's dtype."""

    def __init__(self, *, hidden, heads, head_dim, conv_kernel, layers, dtype):
        self.hidden, self.heads, self.head_dim, self.conv_kernel = hidden, heads, head_dim, conv_kernel
        self.layers, self.dtype = layers, dtype
        self.proj = heads * head_dim

    def describe(self) -> dict:
        return {
            "layers": self.layers,
            "hidden": self.hidden,
            "heads": self.heads,
            "head_dim": self.head_dim,
            "conv_kernel": self.conv_kernel,
            "dtype": str(self.dtype).removeprefix("torch."),
        }


def batch(concurrency: int, tokens: int) -> tuple[list[int], list[int]]:
    """(query_lens, context_lens): concurrency - 1 decodes, then one prefill chunk filling the step."""
    decodes = concurrency - 1
    query = [1] * decodes + [tokens - decodes]
    context = [1000 + (97 * i) % 2900 for i in range(decodes)] + [PREFILL_CONTEXT]
    return query, context


class Ops:
    """vLLM's functions the layer calls (imported after ``install()``: the router patches the
    vendored modules as they are imported)."""

    def __init__(self, device):
        from vllm.model_executor.layers.mamba import mamba_utils
        from vllm.models.kimi_k3.nvidia.ops.third_party.kda import (
            chunk_kda_with_fused_gate,
            fused_recurrent_kda_packed_decode,
        )

        if device.type == "cuda":
            conv = triton_conv_module()
            self.causal_conv1d_fn, self.causal_conv1d_update = conv.causal_conv1d_fn, conv.causal_conv1d_update
        else:  # --smoke: the CPU platform's torch version (the interpreter fails in vLLM's kernels),
            # and a torch decode update (vLLM's CPU one is a compiled op)
            from vllm.model_executor.layers.mamba.ops.causal_conv1d import causal_conv1d_fn

            self.causal_conv1d_fn, self.causal_conv1d_update = causal_conv1d_fn, _causal_conv1d_update_cpu
        self.chunk_kda_with_fused_gate = chunk_kda_with_fused_gate
        self.fused_recurrent_kda_packed_decode = fused_recurrent_kda_packed_decode  # Kimi's pure-decode path
        self.conv_dim_first = mamba_utils.is_conv_state_dim_first()
        self.state_shapes = mamba_utils.MambaStateShapeCalculator.kda_state_shape
        if device.type == "cuda":
            from vllm.model_executor.layers.mamba.ops.gather_initial_states import gather_initial_states

            self.gather_initial_states = gather_initial_states
        else:  # vLLM's asserts a CUDA / XPU state: the same gather in torch
            self.gather_initial_states = _gather_initial_states_cpu


def triton_conv_module():
    """vLLM's causal-conv1d module with its Triton ``causal_conv1d_fn`` / ``causal_conv1d_update``:
    what its CUDA platform runs, and the ones that read the conv tables. vLLM's CPU platform (the
    carried bundle runs it on a GPU host) swaps in torch versions that sync on every call and read
    none of them; there the module is executed once more, apart from ``sys.modules``, with the
    platform saying it is not a CPU."""
    import importlib

    from vllm.platforms import current_platform

    name = "vllm.model_executor.layers.mamba.ops.causal_conv1d"
    if not current_platform.is_cpu():
        return importlib.import_module(name)
    spec = importlib.util.find_spec(name)
    module = importlib.util.module_from_spec(spec)
    platform = type(current_platform)
    is_cpu = platform.is_cpu
    platform.is_cpu = lambda self: False  # only while the module picks its functions
    try:
        spec.loader.exec_module(module)
    finally:
        platform.is_cpu = is_cpu
    return module


def _causal_conv1d_update_cpu(x, conv_state, weight, bias=None, activation=None, conv_state_indices=None, **kwargs):
    """vLLM's ``causal_conv1d_update`` for one token per row (Kimi's decode path), in torch: the
    row's state window and the new token, the silu of their dot with the weights; rows on the null
    block 0 are skipped, as vLLM's kernel skips them."""
    idx = conv_state_indices.long()
    window = torch.cat([conv_state[idx].to(torch.float32), x.to(torch.float32).unsqueeze(-1)], dim=-1)
    out = (window * weight.to(torch.float32)).sum(-1)
    if bias is not None:
        out = out + bias
    out = F.silu(out) if activation in ("silu", "swish", True) else out
    live = idx != 0
    conv_state[idx[live]] = window[live, :, 1:].to(conv_state.dtype)
    result = kwargs.get("out")
    if result is None:
        return out.to(x.dtype)
    result.copy_(out)
    return result


def _gather_initial_states_cpu(state, indices, has_initial_state):
    rows = state.index_select(0, indices.long())
    return torch.where(has_initial_state.view(-1, *([1] * (rows.dim() - 1))), rows, torch.zeros_like(rows))


class Layer:
    """One KDA layer's weights (Kimi-Linear's parameters, random; vLLM's layouts and dtypes)."""

    def __init__(self, shape: Shape, gen, device):
        h, p, d = shape.hidden, shape.proj, shape.head_dim

        def rand(*size, fan_in, dtype=shape.dtype):
            return (torch.randn(*size, generator=gen, device=device) / fan_in**0.5).to(dtype)

        self.in_proj = rand(3 * p + shape.heads + d, h, fan_in=h)  # [q k v | beta | f_a] x hidden
        self.f_b_proj = rand(p, d, fan_in=d)
        self.conv1d = rand(3 * p, 1, shape.conv_kernel, fan_in=shape.conv_kernel, dtype=torch.float32)
        self.A_log = torch.log(torch.rand(shape.heads, generator=gen, device=device) * 15 + 1)
        self.dt_bias = torch.randn(p, generator=gen, device=device) * 0.1
        self.o_proj = rand(h, p, fan_in=p)


class Engine:
    """The model's layers, the runner's buffers, the builders and every method's states."""

    def __init__(self, shape: Shape, builders: dict, ops: Ops, max_reqs: int, max_tokens: int, device):
        from vllm_real_batches import RunnerBuffers

        self.shape, self.builders, self.ops, self.device = shape, builders, ops, device
        gen = torch.Generator(device=device).manual_seed(0)
        self.layers = [Layer(shape, gen, device) for _ in range(shape.layers)]
        self.inputs = RunnerBuffers(max_reqs, max_tokens, device)
        self.x = torch.randn(max_tokens, shape.hidden, generator=gen, device=device).to(shape.dtype)
        conv_shape, recurrent_shape = ops.state_shapes(
            1, shape.heads, shape.head_dim, conv_kernel_size=shape.conv_kernel
        )
        blocks = max_reqs + 1  # block 0 is vLLM's null block
        state_dtype = torch.float32 if shape.dtype == torch.float32 else torch.bfloat16  # kda_state_dtype("auto")
        self.caches = {
            method: [
                (
                    torch.zeros(blocks, *conv_shape, dtype=state_dtype, device=device),
                    torch.zeros(blocks, *recurrent_shape, dtype=torch.float32, device=device),
                )
                for _ in range(shape.layers)
            ]
            for method in builders
        }
        self.build_us = {method: [] for method in builders}
        self.batch = None

    def step(self, method: str) -> torch.Tensor:
        query_lens, context_lens = self.batch
        m = self.inputs.common_metadata(query_lens, context_lens)
        start = time.perf_counter_ns()
        metadata = self.builders[method].build(0, m)
        self.build_us[method].append((time.perf_counter_ns() - start) / 1e3)
        h = self.x[: m.num_actual_tokens]
        for layer, cache in zip(self.layers, self.caches[method], strict=True):
            h = self.layer(h, metadata, layer, cache)
        return h

    def layer(self, hidden, m, w: Layer, cache) -> torch.Tensor:
        """KimiGatedDeltaNetAttention.forward + _forward on a non-spec batch with prefills."""
        s = self.shape
        o = linear_attention(self.ops, s, m, *project(s, hidden, w), w, cache)
        return F.linear(o.reshape(m.num_actual_tokens, s.proj), w.o_proj)

    def states_equal(self) -> bool:
        a, b = (self.caches[m] for m in METHODS)
        return all(torch.equal(x, y) for pa, pb in zip(a, b, strict=True) for x, y in zip(pa, pb, strict=True))


def project(s: Shape, hidden, w: Layer):
    """``forward``'s input GEMMs: ``(mixed_qkv [T, 3P], g1 [1, T, H, D], beta [1, T, H])``."""
    mixed_qkv, beta, f_a = F.linear(hidden, w.in_proj).split([3 * s.proj, s.heads, s.head_dim], dim=-1)
    g1 = F.linear(f_a, w.f_b_proj).reshape(1, hidden.shape[0], s.heads, s.head_dim)
    return mixed_qkv, g1, beta.unsqueeze(0)


def linear_attention(ops: Ops, s: Shape, m, mixed_qkv, g1, beta, w: Layer, cache) -> torch.Tensor:
    """The middle of ``_forward``'s non-spec path with prefills, on the real tokens
    (``m.num_actual_tokens`` of the inputs): three ``causal_conv1d_fn``, the initial states, the
    vendored chunk KDA with ``cu_seqlens`` only, the final states written back."""
    n = m.num_actual_tokens
    mixed_qkv, g1, beta = mixed_qkv[:n], g1[:, :n], beta[:, :n]
    conv_state, recurrent_state = cache
    if not ops.conv_dim_first:
        conv_state = conv_state.transpose(-1, -2)
    weights = w.conv1d.view(w.conv1d.size(0), w.conv1d.size(2)).split(s.proj, dim=0)
    states = conv_state.split(s.proj, dim=-2)
    q, k, v = (
        ops.causal_conv1d_fn(
            x.transpose(0, 1),
            weight,
            None,
            activation="silu",
            conv_states=state,
            has_initial_state=m.has_initial_state,
            cache_indices=m.non_spec_state_indices_tensor,
            query_start_loc=m.non_spec_query_start_loc,
            metadata=m,
        )
        .transpose(0, 1)
        .reshape(1, n, s.heads, s.head_dim)
        for x, weight, state in zip(mixed_qkv.split(s.proj, dim=-1), weights, states, strict=True)
    )
    initial_state = ops.gather_initial_states(recurrent_state, m.non_spec_state_indices_tensor, m.has_initial_state)
    o, last_state = ops.chunk_kda_with_fused_gate(
        q=q,
        k=k,
        v=v,
        raw_g=g1,
        raw_beta=beta,
        A_log=w.A_log,
        g_bias=w.dt_bias,
        lower_bound=None,  # Kimi-Linear's config sets no gate_lower_bound
        initial_state=initial_state,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
        cu_seqlens=m.non_spec_query_start_loc,
    )
    recurrent_state[m.non_spec_state_indices_tensor] = last_state
    return o


# -- the run --------------------------------------------------------------------------------


def _error(exc: BaseException) -> str:
    traceback.print_exc()
    return f"{type(exc).__name__}: {exc}"


def make_builders(kind: str, vllm_config, shape: Shape, device) -> tuple[dict, dict]:
    """method -> builder, and method -> the reason it could not be made."""
    from vllm.model_executor.layers.mamba import mamba_utils
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadataBuilder
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import MambaSpec

    from chunkmeta.integrations import vllm as adapter

    adapter.install()
    if kind == "gdn":
        stock_cls = GDNAttentionMetadataBuilder
    else:  # queries the GPU at import: only here, on request
        try:
            stock_cls = importlib.import_module("vllm.models.kimi_k3.nvidia.kda_metadata").KimiK3KDAMetadataBuilder
        except Exception as exc:  # noqa: BLE001
            error = _error(exc)
            return {}, dict.fromkeys(METHODS, error)
    shapes = mamba_utils.MambaStateShapeCalculator.kda_state_shape(
        1, shape.heads, shape.head_dim, conv_kernel_size=shape.conv_kernel
    )
    spec = MambaSpec(
        block_size=16,
        shapes=shapes,
        dtypes=(shape.dtype, torch.float32),
        mamba_type=MambaAttentionBackendEnum.GDN_ATTN,
    )
    names = [f"model.layers.{i}.self_attn" for i in range(shape.layers)]
    classes = {
        "vllm": stock_cls,
        # what install() makes vLLM use for this backend
        "chunkmeta": adapter.chunkmeta_builder_class(
            stock_cls, reuse_block_table=stock_cls is GDNAttentionMetadataBuilder
        ),
    }
    made, errors = {}, {}
    for method, cls in classes.items():
        try:
            made[method] = cls(spec, names, vllm_config, device)
        except Exception as exc:  # noqa: BLE001  (a method that cannot be made is a result to report)
            errors[method] = _error(exc)
    return made, errors


TORCH_SYNC_WARNING = "called a synchronizing CUDA operation"  # the text torch warns with in "warn" mode


def count_syncs(engine: Engine, method: str) -> dict:
    """One step under ``set_sync_debug_mode("warn")`` (the end-of-step wait outside it): the
    syncs torch reports, and the source lines its warnings point at."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            engine.step(method)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    syncs = [w for w in caught if TORCH_SYNC_WARNING in str(w.message)]
    sites = sorted({f"{Path(w.filename).as_posix().split('site-packages/')[-1]}:{w.lineno}" for w in syncs})
    return {"syncs_per_step": len(syncs), "sync_sites": sites}


def run_shape(engine: Engine, concurrency: int, tokens: int, steps: int, warmup: int, failed: dict) -> dict:
    """One shape: warm-up, the sync count (CUDA), ``steps`` timed steps per method, comparisons.
    ``failed``: method -> error, for methods that cannot run (updated with the shape's own)."""
    engine.batch = batch(concurrency, tokens)
    row = _row(concurrency, tokens)
    cuda = engine.device.type == "cuda"
    wait = torch.cuda.current_stream().synchronize if cuda else (lambda: None)
    failed = dict(failed)

    def attempt(method, fn):
        if method not in failed:
            try:
                return fn()
            except Exception as exc:  # noqa: BLE001  (the other method and the next shapes go on)
                failed[method] = _error(exc)
        return None

    def warm(method):
        for _ in range(warmup):
            out = engine.step(method)
            wait()  # a step's host buffers are rewritten only after its copies ran, as in the runner
        return out

    outputs = {m: attempt(m, lambda m=m: warm(m)) for m in METHODS}
    # both methods take the same steps, so each state history is the same when the paths agree
    syncs = {m: attempt(m, lambda m=m: count_syncs(engine, m)) if cuda else None for m in METHODS}
    methods = [m for m in METHODS if m not in failed]
    for method in methods:
        engine.build_us[method].clear()
    hits_before, last = _router_hits(), {}

    def step(method):
        last[method] = engine.step(method)

    try:
        times = interleaved_ms(step, methods, steps, wait=wait)
    except Exception as exc:  # noqa: BLE001
        row["error"] = _error(exc)
        times = {}
    identical = dict.fromkeys(("warmup_output", "last_output", "states"))
    if len(methods) == 2 and times:
        identical = {
            "warmup_output": torch.equal(outputs["vllm"], outputs["chunkmeta"]),
            "last_output": torch.equal(last["vllm"], last["chunkmeta"]),
            "states": engine.states_equal(),
        }
        row["finite_output"] = bool(torch.isfinite(last["vllm"]).all())  # NaN would make equal outputs differ
    row["identical"] = identical
    row["bit_identical"] = None if None in identical.values() else all(identical.values())
    if "chunkmeta" in times:
        row["router_hits_per_step"] = (_router_hits() - hits_before) / steps
        row["chunkmeta_stats"] = engine.builders["chunkmeta"].chunkmeta_stats()
    for method in METHODS:
        if method not in times:
            row[method] = {"available": False, "error": failed.get(method) or row.get("error")}
            continue
        ms = median(times[method])
        row[method] = {
            "available": True,
            "ms_per_step": ms,
            "ms_p10": percentile(times[method], 10),
            "ms_p90": percentile(times[method], 90),
            "tokens_per_s": tokens / ms * 1e3,
            "build_host_us": median(engine.build_us[method]),
            **(syncs[method] or {"syncs_per_step": None, "sync_sites": [], "why": "no CUDA syncs on CPU"}),
        }
    if row["vllm"]["available"] and row["chunkmeta"]["available"]:
        row["speedup"] = row["vllm"]["ms_per_step"] / row["chunkmeta"]["ms_per_step"]
    return row


def _row(concurrency: int, tokens: int, **extra) -> dict:
    query, _ = batch(concurrency, tokens)
    return {
        "concurrency": concurrency,
        "decodes": concurrency - 1,
        "prefill_tokens": query[-1],
        "tokens": tokens,
        **extra,
    }


def _router_hits() -> int:
    from chunkmeta.integrations import vllm as adapter

    return adapter.stats().get("router_hits", 0)


def target(rows: list[dict], at: int) -> dict:
    """Issue 19's target: >= 5% faster than vLLM's default at concurrency 8, not slower anywhere."""
    speedups = {r["concurrency"]: r.get("speedup") for r in rows}
    measured = [s for s in speedups.values() if s is not None]
    return {
        "at_concurrency": at,
        "speedup_at": speedups.get(at),
        "faster_by_5pct_at": None if speedups.get(at) is None else speedups[at] >= 1.05,
        "not_slower_anywhere": None if not measured else min(measured) >= 1.0,
    }


def format_table(figures: dict, device: str) -> str:
    s = figures["model"]
    lines = [
        f"# vLLM step loop: {device}, {figures['builder']} builder (gdn_prefill_backend="
        f"{figures['gdn_prefill_backend']}), {s['layers']} layers of [GEMMs + causal_conv1d_fn x3 + "
        f"chunk_kda_with_fused_gate (H={s['heads']}, K=V={s['head_dim']}) + GEMM], hidden {s['hidden']}, "
        f"{s['dtype']}, {figures['steps']} steps per method, medians",
        "",
        "| requests | decodes + prefill | vllm ms/step | chunkmeta ms/step | speed-up | vllm syncs/step "
        "| chunkmeta syncs/step | vllm build() µs | chunkmeta build() µs | outputs equal |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in figures["rows"]:
        cells = []
        for method in METHODS:
            m = r.get(method, {})
            if not m.get("available"):
                reason = r.get("skipped") or "failed: " + str(m.get("error") or r.get("error") or "?")
                cells.append(reason.splitlines()[0].replace("|", "/")[:80])
            else:
                cells.append(f"{m['ms_per_step']:.3f}")
        speedup = f"{r['speedup']:.3f}x" if r.get("speedup") else "n/a"

        def get(method, key, fmt):
            value = r.get(method, {}).get(key)
            return "n/a" if value is None else format(value, fmt)

        equal = {True: "yes", False: "NO", None: "n/a"}[r.get("bit_identical")]
        lines.append(
            f"| {r['concurrency']} | {r['decodes']} + {r['prefill_tokens']} | {cells[0]} | {cells[1]} | {speedup} | "
            f"{get('vllm', 'syncs_per_step', 'd')} | {get('chunkmeta', 'syncs_per_step', 'd')} | "
            f"{get('vllm', 'build_host_us', '.0f')} | {get('chunkmeta', 'build_host_us', '.0f')} | {equal} |"
        )
    lines += ["", target_line(figures["target"])]
    for r in figures["rows"]:
        for method in METHODS:
            sites = r.get(method, {}).get("sync_sites")
            if sites:
                lines.append(f"syncs of {method} at {r['concurrency']} requests: {', '.join(sites)}")
    return "\n".join(lines)


def target_line(t: dict | None) -> str:
    if t is None:
        return "target (issue 19): not judged (CPU smoke run: the interpreter's times)"
    verdict = {True: "met", False: "NOT met", None: "not measured"}
    speedup = "n/a" if t["speedup_at"] is None else f"{t['speedup_at']:.3f}x"
    return (
        f"target (issue 19): >= 1.05x at {t['at_concurrency']} requests: {verdict[t['faster_by_5pct_at']]} "
        f"({speedup}); not slower at any shape: {verdict[t['not_slower_anywhere']]}"
    )


def check_smoke_environment() -> None:
    if importlib.util.find_spec("triton") is None:
        sys.exit(
            "--smoke: vLLM's causal_conv1d_fn and its vendored KDA op are Triton kernels, and this Python has "
            "no triton (.venv-vllm installs none). Put one on the path, e.g. the repo's own: "
            "PYTHONPATH=<dir with .venv's triton and triton-*.dist-info> .venv-vllm/bin/python "
            "bench/vllm_step_loop.py --smoke --out DIR"
        )
    import fla_interp

    fla_interp.apply_vllm()
    from vllm.triton_utils import HAS_TRITON

    if not HAS_TRITON:
        sys.exit(
            "--smoke: vLLM disabled Triton (no active GPU driver): run with CUDA_VISIBLE_DEVICES set and empty "
            "before vLLM is imported (the script sets it unless it is already set)."
        )


# defaults: the GPU run (Kimi-Linear's KDA layer, 16 heads), and the CPU smoke run (tiny, fast
# under the interpreter: its cost is per Triton program, ~ tokens x heads)
DEFAULTS = dict(steps=50, warmup=WARMUP_STEPS, layers=24, heads=16, head_dim=128, hidden=2304, tokens=4096)
SMOKE_DEFAULTS = dict(steps=2, warmup=1, layers=1, heads=2, head_dim=16, hidden=32, tokens=16, concurrency="2,4")
DEFAULTS["concurrency"] = ",".join(map(str, CONCURRENCY))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    for name in DEFAULTS:
        kind = str if name == "concurrency" else int
        parser.add_argument(
            f"--{name.replace('_', '-')}", type=kind, help=f"default {DEFAULTS[name]}, smoke {SMOKE_DEFAULTS[name]}"
        )
    parser.add_argument("--builder", choices=("gdn", "kimi_k3"), default="gdn")
    parser.add_argument("--budget-s", type=float, default=0, help="start no new shape after this many seconds")
    parser.add_argument("--smoke", action="store_true", help="CPU: tiny shapes under Triton's interpreter")
    args = parser.parse_args(argv)
    for name, value in (SMOKE_DEFAULTS if args.smoke else DEFAULTS).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    started = time.monotonic()
    vllm_builders.import_vllm()
    warmup = args.warmup
    if args.smoke:
        check_smoke_environment()
    elif not torch.cuda.is_available():
        sys.exit("no CUDA device: vLLM's ops need one (or Triton's interpreter: --smoke)")
    device = torch.device("cpu" if args.smoke else "cuda")
    shape = Shape(
        hidden=args.hidden,
        heads=args.heads,
        head_dim=args.head_dim,
        conv_kernel=4,
        layers=args.layers,
        dtype=torch.float32 if args.smoke else torch.bfloat16,
    )
    concurrency = [int(c) for c in args.concurrency.split(",")]
    with tempfile.TemporaryDirectory() as root:
        # vLLM wants max_num_batched_tokens >= max_num_seqs (the smoke's 64-token steps)
        max_num_seqs = min(MAX_NUM_SEQS, args.tokens)
        config = vllm_builders.configs(
            root, max_num_seqs=max_num_seqs, max_num_tokens=args.tokens, prefix_caching=False
        )["gdn"]
    builders, errors = make_builders(args.builder, config, shape, device)
    ops = Ops(device)
    engine = Engine(shape, builders, ops, max(concurrency), args.tokens, device)
    backend = next((getattr(b, "gdn_prefill_backend", None) for b in builders.values()), None)
    figures = {
        "builder": args.builder,
        "gdn_prefill_backend": backend,
        "model": shape.describe(),
        "steps": args.steps,
        "warmup_steps": warmup,
        "smoke": args.smoke,
        "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": args.tokens,
        "prefill_context": PREFILL_CONTEXT,
        "rows": [],
    }
    for c in concurrency:
        elapsed = time.monotonic() - started
        if args.budget_s and elapsed > args.budget_s:
            why = f"not run: {elapsed:.0f} s elapsed, over --budget-s {args.budget_s:g}"
            figures["rows"].append(_row(c, args.tokens, skipped=why))
            continue
        print(f"[{elapsed:6.1f} s] {c} requests ...", flush=True)
        try:
            figures["rows"].append(run_shape(engine, c, args.tokens, args.steps, warmup, errors))
        except Exception as exc:  # noqa: BLE001  (the run goes on to the next shape)
            figures["rows"].append(_row(c, args.tokens, error=_error(exc)))
    # the target is about GPU step times: the interpreter's say nothing about it
    figures["target"] = None if args.smoke else target(figures["rows"], at=concurrency[0])
    figures["seconds"] = round(time.monotonic() - started, 1)
    record = runs.save("vllm_step_loop", figures, script="bench/vllm_step_loop.py", argv=argv, out=args.out)
    print(format_table(figures, record["device"].get("gpu", "cpu")))
    return 0 if all(r.get("bit_identical") for r in figures["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
