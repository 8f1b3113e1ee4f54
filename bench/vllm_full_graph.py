"""Issue 34: a hybrid model's mixed prefill+decode step in one CUDA graph, on vLLM 0.33.0's own ops.

    python bench/vllm_full_graph.py --out DIR [--exact-batches 200] [--exact-layers kda,gdn,gdn_with_decodes]
                                    [--steps 30] [--layers 24]
    python bench/vllm_full_graph.py --smoke --out DIR   (CPU, vLLM's ops under Triton's interpreter)

One record (``bench/results.py``: ``vllm_full_graph.runs.jsonl``) under ``--out``, three parts:

**exact** (``bench/full_graph_exact.py``): one layer's linear-attention part, Kimi-Linear's KDA and
Qwen3-Next's GDN, over ``--exact-batches`` random batches at each of ``--exact-shapes`` (decodes,
prefill chunks with and without a cached prefix, sometimes trailing zero-length rows; padded
request rows in every batch): the graph-safe forward (``integrations/vllm/mixed_step``) captured
once on its bucket and replayed (staging and replay under ``set_sync_debug_mode("error")``),
against vLLM's eager path on the exact batch with the stock builder's metadata. Bit for bit: every
real token's output, every real block's conv and recurrent states; GDN's decode rows, which vLLM
sends through its recurrent kernel, by their largest difference.

**steps**: the whole step of ``--layers`` Kimi-Linear KDA layers (``bench/vllm_step_loop.py``'s
layer: input GEMMs, the linear-attention part, ``o_proj``), a new random batch every step, per
shape (requests x tokens), methods interleaved:

* ``vllm_piecewise``     what vLLM runs for a mixed step: the GEMM pieces between the
                         linear-attention ops captured as CUDA graphs for the token bucket (vLLM's
                         piecewise / breakable graphs), the linear-attention ops eager on the real
                         tokens, vLLM's metadata (the stock builder; the KDA op's own
                         ``prepare_chunk_indices``, with its sync);
* ``chunkmeta_piecewise`` the same with chunkmeta's builder (no sync);
* ``chunkmeta_full``     the whole step one graph per bucket (tokens x request bucket), captured
                         once, ``stage()`` + replay per step. A shape ``RxT@G`` keys that graph
                         on G request rows instead of the smallest bucket >= R (vLLM's own keys
                         give ``min(T, max_num_seqs)``): what padded rows cost.

Per shape: ms/step (medians), syncs per step (``set_sync_debug_mode("warn")``), graph memory (the
pool's reserved bytes) and capture time, whether ``chunkmeta_full``'s outputs and states equal
``vllm_piecewise``'s (both run their GEMMs at the bucket's token count), its device time
(torch.profiler) against its wall time and against ``vllm_piecewise``'s, and issue 34's targets.

``ms_per_step`` is serial (inputs, run, wait, all timed; ``mean_ms_per_step`` its mean);
``async_ms_per_step`` pipelines the same methods over the serial rounds' batches, one step in
flight, because that is how vLLM 0.33.0 runs by default: async scheduling is on unless ruled out
(vllm/config/vllm.py:1685-1719), and the runner builds step N+1 while the GPU runs step N, waiting
only for the event recorded after the previous step's input preparation (its copies and the
attention metadata) before rewriting its pinned buffers (v1/worker/gpu_model_runner.py:3572-3584,
``synchronize_input_prep``). A step that syncs cannot hide the next one's host work.

**decode**: decode-only steps (``--decode-shapes`` requests), vLLM's FULL decode graph (Kimi's
decode kernels) against the bucket's graph (the chunked path), from the same states.

``--smoke`` (CPU): tiny shapes, no graphs (CUDA only): every path runs eagerly, the graph-safe
forwards on their padded buckets, so the exact part still compares padded against exact shapes;
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
from full_graph_common import (  # noqa: E402
    Bench,
    capture,
    linear_attention_eager,
    linear_attention_mixed,
    random_batch,
    request_bucket,
    stage,
    stage_args,
)
from full_graph_exact import GdnCase, KdaCase, run_exact  # noqa: E402

from chunkmeta.timing import device_us_per_call, interleaved_ms, median  # noqa: E402

METHODS = ("vllm_piecewise", "chunkmeta_piecewise", "chunkmeta_full")

# -- steps: the whole step, three methods -------------------------------------------------------


class Piecewise:
    """The GEMM pieces of a step for one token bucket, as vLLM's piecewise graphs hold them:
    ``pre[l]`` (input GEMMs of layer l) and ``post[l]`` (``o_proj``), each segment between two
    linear-attention ops one graph; the linear-attention ops run eagerly between replays."""

    def __init__(self, bench: Bench, tokens: int, mode: str):
        s, dev = bench.shape, bench.device
        self.bench, self.tokens = bench, tokens
        self.h = torch.zeros(tokens, s.hidden, dtype=s.dtype, device=dev)
        self.o = torch.zeros(tokens, s.proj, dtype=s.dtype, device=dev)
        self.proj = [None] * s.layers
        self.segments = []
        for i in range(s.layers + 1):
            self.segments.append(self._segment(i, mode))

    def _pre(self, i):
        self.proj[i] = loop.project(self.bench.shape, self.h, self.bench.engine.layers[i])

    def _post(self, i):
        self.h.copy_(F.linear(self.o, self.bench.engine.layers[i].o_proj))

    def _segment(self, i, mode):
        layers = self.bench.shape.layers

        def run():
            if i > 0:
                self._post(i - 1)
            if i < layers:
                self._pre(i)

        if mode == "off":
            return run
        run()  # warm-up
        return capture(run, mode).replay

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

    def __init__(self, bench: Bench, method: str, tokens: int, requests: int, mode: str):
        from chunkmeta.integrations.vllm.full_graph import bucket_levels
        from chunkmeta.integrations.vllm.mixed_step import MixedStepInputs

        s, dev = bench.shape, bench.device
        self.bench, self.method, self.tokens = bench, method, tokens
        self.inputs = MixedStepInputs(tokens, requests, dev, levels=bucket_levels(dev))
        self.h = torch.zeros(tokens, s.hidden, dtype=s.dtype, device=dev)
        self.capture_s = self.pool_bytes = self.replay = None
        if mode != "off":
            stage(self.inputs, bench.engine.inputs.common_metadata([tokens // requests] * requests, [0] * requests))
            caches = bench.engine.caches[method]
            self._run([tuple(torch.zeros_like(t) for t in c) for c in caches])  # warm-up on scratch states
            captured = capture(lambda: self._run(caches), mode, keep=[t for c in caches for t in c])
            self.replay, self.out = captured.replay, captured.out
            self.capture_s, self.pool_bytes = captured.seconds, captured.pool_bytes

    def _run(self, caches):
        b, s = self.bench, self.bench.shape
        h = self.h
        for w, cache in zip(b.engine.layers, caches, strict=True):
            o = linear_attention_mixed(b, self.inputs, *loop.project(s, h, w), w, cache)
            h = F.linear(o.reshape(self.tokens, s.proj), w.o_proj)
        return h

    def load(self, m, x) -> None:
        """A step's inputs into the graph's: ``stage()`` (chunkmeta's one fill) and the hidden states."""
        stage(self.inputs, m)
        self.load_hidden(x)

    def load_hidden(self, x) -> None:
        self.h[: x.shape[0]].copy_(x)

    def launch(self) -> torch.Tensor:
        """The step on the loaded inputs: the replay, or on CPU without graphs the eager run."""
        if self.replay is None:
            return self._run(self.bench.engine.caches[self.method])
        self.replay()
        return self.out

    def step(self, m, x) -> torch.Tensor:
        self.load(m, x)
        return self.launch()


def run_steps(bench: Bench, requests: int, tokens: int, steps: int, seed: int, mode: str, rows: int) -> dict:
    dev = bench.device
    cuda = dev.type == "cuda"
    rng = np.random.default_rng(seed)
    for caches in bench.engine.caches.values():  # every method starts from the same (zero) states
        for cache in caches:
            for t in cache:
                t.zero_()
    row = {"requests": requests, "tokens": tokens, "request_bucket": rows}
    piecewise = Piecewise(bench, tokens, mode)
    full = FullStep(bench, "chunkmeta_full", tokens, rows, mode)
    row["chunkmeta_full_capture_s"], row["chunkmeta_full_graph_bytes"] = full.capture_s, full.pool_bytes
    batch = {}
    last = {}

    def next_batch():
        batch["case"] = random_batch(rng, requests, tokens)

    def run(method, case=None, inputs_prepared=lambda: None):
        """One step; ``inputs_prepared()`` once its inputs and metadata are staged, where vLLM's
        runner records the event the next step's input preparation waits on."""
        query, context = batch["case"] if case is None else case
        m = bench.engine.inputs.common_metadata(query, context)
        x = bench.engine.x[: m.num_actual_tokens]
        if method == "chunkmeta_full":
            full.load(m, x)
            inputs_prepared()
            last[method] = full.launch()[: m.num_actual_tokens]
            return
        metadata = bench.builders[method].build(0, m)
        inputs_prepared()
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
    calls, drawn = [0], []

    def timed(method):
        if calls[0] % len(METHODS) == 0:
            next_batch()  # a new batch every round, the same for every method (whatever the order)
            drawn.append(batch["case"])
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
    # the serial rounds' batches again, so that the two figures differ by the pipelining alone:
    # an eager step's host time depends on its batch, and a first pipelined run on other batches
    # had vllm_piecewise 27% slower than serially at 64 x 4096, unexplained
    # (vllm_full_graph@2026-12-06T02:32:13Z)
    event = (lambda: torch.cuda.Event(blocking=True)) if cuda else NoEvent  # blocking: as vLLM's runner makes them
    overlapped = pipelined_ms(run, METHODS, drawn, event, wait)
    # every method ran the same batches again, so their states must still agree: a pinned buffer
    # rewritten before its copy ran would show here
    row["async_states_equal"] = bench.states_equal("vllm_piecewise", "chunkmeta_full")
    for method in METHODS:
        row[method] = {
            "ms_per_step": median(times[method]),
            # what the pipelined figure (a block's wall time over its steps) compares with
            "mean_ms_per_step": sum(times[method]) / len(times[method]),
            "async_ms_per_step": overlapped[method],
            "syncs_per_step": syncs.get(method),
        }
    base = row["vllm_piecewise"]["ms_per_step"]
    row["speedup_full"] = base / row["chunkmeta_full"]["ms_per_step"]
    row["speedup_piecewise"] = base / row["chunkmeta_piecewise"]["ms_per_step"]
    row["speedup_full_async"] = overlapped["vllm_piecewise"] / overlapped["chunkmeta_full"]
    if cuda:  # after the comparisons: these steps move the profiled methods' states alone
        kernel_ms, launches = device_profile(lambda: run("chunkmeta_full"), wait)
        row["chunkmeta_full_kernel_ms"], row["chunkmeta_full_launches_per_step"] = kernel_ms, launches
        row["chunkmeta_full_over_kernels"] = row["chunkmeta_full"]["ms_per_step"] / kernel_ms
        row["chunkmeta_full_async_over_kernels"] = overlapped["chunkmeta_full"] / kernel_ms
        # the baseline's own GPU work: where the step is GPU-bound (8 x 4096), a speed-up over it
        # needs vllm_piecewise's host time, not its kernels, to be the larger
        row["vllm_piecewise_kernel_ms"] = device_profile(lambda: run("vllm_piecewise"), wait)[0]
        # where the rest goes: the graph's own GPU time (its kernels and the gaps between its
        # nodes) against the step's wall time (that plus staging, the replay's launch, the wait)
        row["chunkmeta_full_replay_ms"] = device_us_per_call(full.replay, calls=5, lead_us=20000, repeats=3) / 1e3
    if full.replay is not None:  # a captured (or, on CPU, simulated) graph
        row["chunkmeta_full_host_ms"] = host_parts(bench, full, next_batch, batch, wait, steps=20 if cuda else 2)
    return row


class NoEvent:
    """A CUDA event's stand-in on the CPU: with no stream running ahead of the host there is
    nothing to wait for, but ``--smoke`` still runs the pipelined path."""

    def record(self) -> None:
        pass

    def synchronize(self) -> None:
        pass


def pipelined(step, batches: list, event) -> None:
    """``step(case, inputs_prepared)`` over ``batches`` with one step in flight, as vLLM's async
    scheduling runs them: step N+1's inputs are built and its work launched while the GPU runs
    step N, then step N's completion is awaited (the runner's sampled-token copy)."""
    prepared, previous = event(), None
    for case in batches:
        # the harness's runner rewrites the pinned host buffers that the previous step's
        # non-blocking copies read from: without this wait they could copy the next step's inputs
        prepared.synchronize()
        step(case, prepared.record)
        done = event()
        done.record()
        if previous is not None:
            previous.synchronize()
        previous = done


def pipelined_ms(run, methods, batches: list, event, wait, blocks: int = 3) -> dict[str, float]:
    """Per method, ms/step of ``run(method, case, inputs_prepared)`` pipelined over ``batches`` (the
    same list for each): the median over ``blocks`` blocks, each timed to its final ``wait()``,
    the methods rotated block by block (``interleaved_ms``) so drift weighs on each alike."""
    times = interleaved_ms(
        lambda method: pipelined(lambda case, prepared: run(method, case, prepared), batches, event),
        list(methods),
        blocks,
        wait=wait,
    )
    return {method: median(ms) / len(batches) for method, ms in times.items()}


# -- decode: decode-only steps, vLLM's FULL decode graph against the bucket's graph ---------------


class DecodeStep:
    """vLLM's FULL decode graph of the step (FULL_AND_PIECEWISE's decode routine, which a mixed
    FULL mode gives up: decode-only batches then replay their bucket's mixed graph): per layer the
    input GEMMs, Kimi's pure-decode path (kimi_gdn_linear_attn.py:595-627: ``causal_conv1d_update``
    over the packed q/k/v, ``fused_recurrent_kda_packed_decode`` on the recurrent state in place)
    and ``o_proj``, for ``requests`` one-token rows, captured once."""

    def __init__(self, bench: Bench, method: str, requests: int, mode: str):
        s, dev = bench.shape, bench.device
        self.bench, self.method, self.requests = bench, method, requests
        self.h = torch.zeros(requests, s.hidden, dtype=s.dtype, device=dev)
        self.indices = torch.zeros(requests, dtype=torch.int32, device=dev)  # the builder's persistent buffer
        self.replay = None
        if mode != "off":
            self.indices.copy_(torch.arange(1, requests + 1, dtype=torch.int32, device=dev))
            caches = bench.engine.caches[method]
            self._run([tuple(torch.zeros_like(t) for t in c) for c in caches])  # warm-up on scratch states
            captured = capture(lambda: self._run(caches), mode, keep=[t for c in caches for t in c])
            self.replay, self.out = captured.replay, captured.out

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
        if self.replay is None:
            return self._run(self.bench.engine.caches[self.method])
        self.replay()
        return self.out


DECODE_METHODS = ("vllm_full_decode", "chunkmeta_full")


def run_decode(bench: Bench, requests: int, steps: int, seed: int, mode: str) -> dict:
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
        "vllm_full_decode": DecodeStep(bench, "vllm_piecewise", requests, mode),
        "chunkmeta_full": FullStep(bench, "chunkmeta_full", requests, requests, mode),
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
            row[method]["device_ms"] = device_profile(lambda method=method: run(method), wait)[0]
    row["chunkmeta_over_vllm"] = row["chunkmeta_full"]["ms_per_step"] / row["vllm_full_decode"]["ms_per_step"]
    return row


# issue 34's targets: chunkmeta_full against vllm_piecewise per (requests, tokens)
TARGET_SPEEDUPS = {(8, 256): 3.0, (8, 1024): 3.0, (8, 4096): 1.5}


def targets(rows: list[dict]) -> dict:
    """Whether each speed-up target is met, never slower anywhere, within 10% of its kernels; the
    ``_async`` keys the same of the pipelined figures (issue 34's targets are the serial ones)."""
    done = [r for r in rows if "speedup_full" in r]

    def per_shape(key):
        return {
            f"{r['requests']}x{r['tokens']}": r[key] >= TARGET_SPEEDUPS[(r["requests"], r["tokens"])]
            for r in done
            if (r["requests"], r["tokens"]) in TARGET_SPEEDUPS and key in r
        }

    def within_10pct(key):
        over = [r[key] for r in done if key in r]
        return None if not over else max(over) <= 1.10

    return {
        "speedups_met": per_shape("speedup_full"),
        "speedups_met_async": per_shape("speedup_full_async"),
        "never_slower": None if not done else min(r["speedup_full"] for r in done) >= 1.0,
        "within_10pct_of_kernels": within_10pct("chunkmeta_full_over_kernels"),
        "within_10pct_of_kernels_async": within_10pct("chunkmeta_full_async_over_kernels"),
        "bit_identical_states": None if not done else all(r["states_equal"] for r in done),
    }


def host_parts(bench: Bench, full: FullStep, next_batch, batch: dict, wait, steps: int = 20) -> dict:
    """Medians over ``steps`` new batches of a ``chunkmeta_full`` step's serial parts, in ms: the
    runner's inputs (the harness's vLLM ``CommonAttentionMetadata``), ``load`` (the three after it
    summed), the replay's launch, then the wait for the GPU (the graph's time less what ran while
    the host was still launching). ``load``'s parts: ``stage_args`` (what vLLM's own builder
    derives too: the state indices' column, ``compute_num_computed_tokens()``), ``stage``
    (chunkmeta's checks, fill and copies) and ``hidden`` (the hidden states' copy in)."""
    names = ("inputs", "stage_args", "stage", "hidden", "launch", "wait")
    parts = {name: [] for name in names}
    for _ in range(steps):
        next_batch()
        query, context = batch["case"]
        marks = [time.perf_counter()]
        m = bench.engine.inputs.common_metadata(query, context)
        marks.append(time.perf_counter())
        args = stage_args(m)
        marks.append(time.perf_counter())
        full.inputs.stage(*args)
        marks.append(time.perf_counter())
        full.load_hidden(bench.engine.x[: m.num_actual_tokens])
        marks.append(time.perf_counter())
        full.replay()
        marks.append(time.perf_counter())
        wait()
        marks.append(time.perf_counter())
        for name, a, b in zip(names, marks[:-1], marks[1:], strict=True):
            parts[name].append((b - a) * 1e3)
    figures = {name: median(values) for name, values in parts.items()}
    figures["load"] = median([sum(v) for v in zip(parts["stage_args"], parts["stage"], parts["hidden"], strict=True)])
    return figures


def device_profile(step, wait, repeats: int = 3) -> tuple[float, float]:
    """``(ms, launches)``: the GPU's own time in one ``step`` (torch.profiler: every kernel, copy
    and fill, graph replays included) and how many of those it ran, the means of ``repeats``:
    what a step that is not host-bound takes, gaps between kernels left out."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    wait()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            step()
        wait()
    events = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    return sum(e.device_time for e in events) / 1e3 / repeats, len(events) / repeats


def format_tables(figures: dict, device: str) -> str:
    lines = [f"# vLLM mixed step in one CUDA graph: {device}, {figures['model']}", "", "## exact", ""]
    for e in figures["exact"]:
        if "error" in e:
            lines.append(f"{e['layer']}: failed: {e['error'].splitlines()[0][:160]}")
            continue
        how = {
            "cuda": "captured once, replayed",
            "breakable": "captured once in vLLM's breakable graph before an eager break, replayed",
            "simulate": "capture simulated (CPU)",
            "off": "eager",
        }[e["captured"]]
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
        "async ms (vllm / cm pw / cm full) | async full speed-up | "
        "full / its kernels (async; kernel ms, launches; the graph's GPU ms) | syncs (vllm / cm pw / cm full) | "
        "capture s | graph MiB | outputs / states equal |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in figures["steps"]:
        if "error" in r:
            lines.append(f"| {r['requests']} x {r['tokens']} | failed: {r['error'][:80]} |")
            continue
        syncs = " / ".join("n/a" if r[m]["syncs_per_step"] is None else str(r[m]["syncs_per_step"]) for m in METHODS)
        mib = "n/a" if r["chunkmeta_full_graph_bytes"] is None else f"{r['chunkmeta_full_graph_bytes'] / 2**20:.0f}"
        cap = "n/a" if r["chunkmeta_full_capture_s"] is None else f"{r['chunkmeta_full_capture_s']:.2f}"
        overlapped = " / ".join(f"{r[m]['async_ms_per_step']:.3f}" for m in METHODS)
        over = "n/a"
        if "chunkmeta_full_over_kernels" in r:
            host = r["chunkmeta_full_host_ms"]
            over = (
                f"{r['chunkmeta_full_over_kernels']:.2f}x (async {r['chunkmeta_full_async_over_kernels']:.2f}x; "
                f"{r['chunkmeta_full_kernel_ms']:.3f} ms in "
                f"{r['chunkmeta_full_launches_per_step']:.0f} kernels; graph {r['chunkmeta_full_replay_ms']:.3f} ms; "
                f"vllm_piecewise's kernels {r['vllm_piecewise_kernel_ms']:.3f} ms; "
                f"host inputs {host['inputs']:.3f} / load {host['load']:.3f} (args {host['stage_args']:.3f}, "
                f"stage {host['stage']:.3f}, hidden {host['hidden']:.3f}) / launch {host['launch']:.3f} / "
                f"wait {host['wait']:.3f} ms)"
            )
        lines.append(
            f"| {r['requests']} x {r['tokens']} | {r['vllm_piecewise']['ms_per_step']:.3f} | "
            f"{r['chunkmeta_piecewise']['ms_per_step']:.3f} | {r['chunkmeta_full']['ms_per_step']:.3f} | "
            f"{r['speedup_full']:.2f}x | {overlapped} | {r['speedup_full_async']:.2f}x | {over} | {syncs} | {cap} | "
            f"{mib} | "
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
    lines += [
        "",
        f"targets (issue 34): {t}" if t else "targets (issue 34): not judged (a CPU smoke run, or no steps part)",
    ]
    return "\n".join(lines)


# the exact part's layers by name (full_graph_exact's cases): each made from (bench, tokens, blocks)
EXACT_CASES = {
    "kda": lambda bench, tokens, blocks: KdaCase(bench, tokens),
    "gdn": lambda bench, tokens, blocks: GdnCase(bench, tokens, blocks),
    "gdn_with_decodes": lambda bench, tokens, blocks: GdnCase(bench, tokens, blocks, True),
}
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
    parser.add_argument("--parts", default="exact,steps,decode", help="comma-separated: exact, steps, decode")
    # 200 batches of one layer at 32 x 512 take ~4 min on an H100: one call of 10 min holds two
    parser.add_argument(
        "--exact-layers", default=",".join(EXACT_CASES), help="the exact part's layers, comma-separated"
    )
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument(
        "--levels",
        type=int,
        default=0,
        choices=(0, 1),
        help="1: the buckets' kernels on levels (CHUNKMETA_VLLM_LEVELS)",
    )
    parser.add_argument(
        "--simulate-graphs", action="store_true", help="--smoke: run the capture and replay paths with no graph"
    )
    parser.add_argument(
        "--breakable",
        action="store_true",
        help="the exact part in vLLM's breakable capture (Kimi-Linear's piecewise graphs), not one CUDA graph",
    )
    args = parser.parse_args(argv)
    from chunkmeta.integrations.vllm.full_graph import LEVELS_ENV

    os.environ[LEVELS_ENV] = str(args.levels)  # read by every bucket made below
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
    mode = "cuda" if not args.smoke else "simulate" if args.simulate_graphs else "off"
    shape = loop.Shape(
        hidden=args.hidden, heads=args.heads, head_dim=args.head_dim, conv_kernel=4, layers=args.layers,
        dtype=torch.float32 if args.smoke else torch.bfloat16,
    )  # fmt: skip

    def parse(text):
        """``RxT`` (R requests, T tokens, the graph of ``request_bucket(R)`` rows) or ``RxT@G``
        (a graph of G rows: the padded-row measurement)"""
        out = []
        for shape in text.split(","):
            dims, _, rows = shape.partition("@")
            r, t = (int(v) for v in dims.split("x"))
            out.append((r, t, int(rows) if rows else request_bucket(r)))
        return out

    steps_shapes, exact_shapes = parse(args.shapes), [(r, t) for r, t, _ in parse(args.exact_shapes)]
    shapes = [(r, t) for r, t, _ in steps_shapes]
    exact_layers = set(args.exact_layers.split(","))
    if exact_layers - set(EXACT_CASES):
        parser.error(f"--exact-layers: from {', '.join(EXACT_CASES)}, not {sorted(exact_layers)}")
    max_reqs = max([g for _, _, g in steps_shapes] + [request_bucket(r) for r, _ in exact_shapes])
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
    figures = {"model": shape.describe(), "smoke": args.smoke, "capture": mode, "steps_per_shape": args.steps,
               "levels": args.levels}  # fmt: skip
    parts = set(args.parts.split(","))
    figures["parts"] = sorted(parts)
    figures["exact"] = []
    for requests, tokens in exact_shapes if "exact" in parts else ():
        blocks = max_reqs + 1
        for case in (make(bench, tokens, blocks) for name, make in EXACT_CASES.items() if name in exact_layers):
            try:
                how = "breakable" if args.breakable and mode == "cuda" else mode
                figures["exact"].append(run_exact(bench, case, requests, tokens, args.exact_batches, args.seed, how))
            except Exception as exc:  # noqa: BLE001  (the other layers and the steps go on)
                figures["exact"].append({"layer": case.name, "error": loop._error(exc), "bit_identical": False})
            verdict = figures["exact"][-1]["bit_identical"]
            print(f"[{time.monotonic() - started:6.1f} s] exact {case.name} {requests}x{tokens}: {verdict}", flush=True)
    figures["steps"] = []
    for requests, tokens, rows in steps_shapes if "steps" in parts else ():
        try:
            figures["steps"].append(run_steps(bench, requests, tokens, args.steps, args.seed, mode, rows))
        except Exception as exc:  # noqa: BLE001  (the next shapes go on)
            figures["steps"].append({"requests": requests, "tokens": tokens, "error": loop._error(exc)})
        print(f"[{time.monotonic() - started:6.1f} s] {requests} x {tokens} done", flush=True)
    figures["decode"] = []
    for requests in (int(r) for r in args.decode_shapes.split(",")) if "decode" in parts else ():
        try:
            figures["decode"].append(run_decode(bench, requests, args.steps, args.seed, mode))
        except Exception as exc:  # noqa: BLE001
            figures["decode"].append({"requests": requests, "error": loop._error(exc)})
        print(f"[{time.monotonic() - started:6.1f} s] decode {requests} done", flush=True)
    # the interpreter's times say nothing; a run without the steps part judges none
    figures["targets"] = None if args.smoke or not figures["steps"] else targets(figures["steps"])
    figures["seconds"] = round(time.monotonic() - started, 1)
    record = runs.save("vllm_full_graph", figures, script="bench/vllm_full_graph.py", argv=argv, out=args.out)
    print(format_tables(figures, record["device"].get("gpu", "cpu")))
    ok = all(e["bit_identical"] for e in figures["exact"]) and all(r.get("states_equal") for r in figures["steps"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
