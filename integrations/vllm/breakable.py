"""Kimi-Linear's KDA inside vLLM's breakable CUDA graphs (Model Runner V2), where its MLA layers
keep every mixed step off FULL graphs on Hopper (docs/notes/issue48-breakable.md).

vLLM 0.33.0 runs Kimi-Linear with breakable piecewise graphs (config/vllm.py:76-98): one graph
per capture size ``N``, keyed by ``N`` alone, whose segments are replayed in order with every
``eager_break_during_capture`` function run eagerly between them, each KDA and each MLA layer
among them. With ``CHUNKMETA_VLLM_FULL_GRAPH=1`` each size gets buckets ``(N, R)`` for ``R`` in
``request_buckets(N, max_num_seqs)`` (vLLM's capture has ``min(N, max_num_seqs)`` rows) and one
graph per bucket, keyed by ``R`` beside vLLM's key: its capture stages the bucket, the KDA
layers then run chunkmeta's graph-safe forward inline, and the graph holds them (the MLA layers
stay breaks). Which graph holds them is fixed when it is captured (``gate``).

Fail closed, in three places:

* dispatch (``graph_dispatch.mrv2_dispatch``): a step that cannot be staged never gets the graph;
  it runs eagerly;
* capture (``gate``): a graph whose capture not every chunkmeta builder staged may hold some
  KDA layers (those whose builder staged) and break at others: its shape is refused, so no step
  is staged for it, and it is never replayed (below);
* replay (``gate``): a graph captured with chunkmeta's buckets replays only a step every
  builder (and every KV-cache group's view) staged for it (``MixedDispatch.fully_staged``); any
  other step runs the model eagerly, counted, one warning: each layer then takes the graph-safe
  path where its metadata carries a staged bucket and vLLM's path, on chunkmeta's eager tables,
  where not.
"""

from __future__ import annotations

import functools
import os

from chunkmeta.integrations.vllm.full_graph import KIMI_ARCHITECTURES
from chunkmeta.integrations.vllm.graph_dispatch import fast_prefill_refusal, make_buckets, request_buckets

# "1": the breakable graphs get buckets. Off by default until run on a GPU: the graph-safe KDA
# has been captured in FULL graphs on an H100, never inside breakable segments beside Kimi's MLA
# breaks, and a capture that fails there stops vLLM's start-up
BREAKABLE_ENV = "CHUNKMETA_VLLM_BREAKABLE"
UNSTAGED = "a breakable graph holding chunkmeta's KDA met a step not staged by every builder: the model ran eagerly"


def breakable_refusal(vllm_config, manager, builders, environ=None) -> str | None:
    """Why an MRV2 manager's breakable graphs get no bucket, or None."""
    if not getattr(manager, "use_breakable_cg", False):
        return "no breakable CUDA graphs"
    if (os.environ if environ is None else environ).get(BREAKABLE_ENV, "0").strip() != "1":
        return f"{BREAKABLE_ENV}=1 turns them on (not yet run on a GPU)"
    architectures = set(getattr(vllm_config.model_config, "architectures", None) or ())
    if not architectures & KIMI_ARCHITECTURES:
        return f"architectures {sorted(architectures)}: no KDA layer that runs inside a breakable graph"
    parallel = vllm_config.parallel_config
    if parallel.data_parallel_size > 1 or manager.ubatch_runner is not None:
        return "data parallelism or micro-batching"
    if list(manager.lora_capture_cases) != [0]:
        return "LoRA (its graphs share one key per size)"
    why = fast_prefill_refusal(vllm_config)
    if why is not None:
        return why
    if not builders or not all(b._mixed_active() and b._chunkmeta_family == "gdn" for b in builders):
        return "a chunkmeta builder that serves no mixed KDA step"
    return None


def add_breakable_buckets(manager, builders, record) -> set[tuple[int, int]]:
    """For each of the manager's piecewise capture sizes ``N``, a bucket ``(N, R)`` in every
    builder for ``R`` in ``request_buckets(N, max_num_seqs)``, made now (before capture); a shape
    whose bucket cannot be made is left out, its cause to ``record``. vLLM captures ``(N,
    min(N, max_num_seqs))``; each smaller ``R`` gets a capture-only descriptor ``(PIECEWISE, N,
    R)`` (not a dispatch candidate: dispatched, MRV2 would pad the step's rows to it,
    model_runner.py:1462-1484) and its own graph under the runner's key (``gate``), so a step of
    ``r`` requests carries at most ``max(2 r, 8)`` rows (vLLM's breakable replay carries ``r``:
    its KDA is an eager break on the step's own rows). A size whose top bucket cannot be made
    keeps vLLM's graph alone. Returns the shapes, also in ``record.breakable``."""
    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.worker.gpu.cudagraph_utils import BatchExecutionDescriptor

    piecewise = manager._capture_descs.get(CUDAGraphMode.PIECEWISE, [])
    sizes = {d.num_tokens for d in piecewise}
    shapes = {(n, r) for n in sizes for r in request_buckets(n, manager.max_num_reqs)}
    made = make_buckets(builders, shapes, record._turn_away)
    # vLLM's own capture is the top bucket's: a size without it keeps vLLM's graph, no bucket
    record.breakable = {(n, r) for n, r in made if (n, min(n, manager.max_num_reqs)) in made}
    for shape in made - record.breakable:
        for builder in builders:
            builder.chunkmeta_buckets.pop(shape, None)
    extra = [
        BatchExecutionDescriptor(CUDAGraphMode.PIECEWISE, n, r)
        for n, r in record.breakable
        if r < min(n, manager.max_num_reqs)
    ]
    # captured largest first, as vLLM's, most requests first within a size
    manager._capture_descs[CUDAGraphMode.PIECEWISE] = sorted(
        [*piecewise, *extra], key=lambda d: (d.num_tokens, d.num_reqs or manager.max_num_reqs), reverse=True
    )
    return record.breakable


def gate(manager, record) -> None:
    """Wrap ``manager.init_breakable_cg_runner`` (this instance) so that the runner it makes keys
    its graphs by the request rows of the bucket staged (``(N, R)``: one graph per bucket) and is
    gated: ``_capture`` notes the graph's bucket and refuses it unless every builder staged the
    capture, ``_replay`` replays such a graph only for a step every builder staged for it, else
    runs the runner's model eagerly."""
    original = manager.init_breakable_cg_runner

    def rows(*args, **kwargs):
        # the request rows of the graph the step in flight (or the capture) is staged for
        return record.current[1] if record.current is not None else None

    @functools.wraps(original)
    def init_breakable_cg_runner(model, key_fn=None):
        ours = rows if key_fn is None else (lambda *a, **k: (key_fn(*a, **k), rows()))
        original(model, ours)
        runner = manager.breakable_cg_runner
        if runner is not None and not getattr(runner, "_chunkmeta_gated", False):
            _gate_runner(runner, record)

    manager.init_breakable_cg_runner = init_breakable_cg_runner


def _gate_runner(runner, record) -> None:
    capture, replay = runner._capture, runner._replay

    def _capture(entry, args, kwargs):
        # a layer whose builder staged the capture runs inside the graph even where another did
        # not: such a graph is gated whatever happens, and replayed only for a fully staged step
        shape = record.current
        entry.chunkmeta_shape = shape
        if shape is not None and not (shape[0] == entry.batch_descriptor.num_tokens and record.fully_staged()):
            record.refuse(shape)  # no step is staged for it: every one runs eagerly
        return capture(entry, args, kwargs)

    def _replay(entry, args, kwargs):
        shape = getattr(entry, "chunkmeta_shape", None)
        if shape is not None and not (record.current == shape and record.fully_staged()):
            record._turn_away(UNSTAGED)
            return runner.runnable(*args, **kwargs)
        return replay(entry, args, kwargs)

    runner._capture, runner._replay = _capture, _replay
    runner._chunkmeta_gated = True
