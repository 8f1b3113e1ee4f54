"""Which steps replay a mixed FULL CUDA graph: the graphs chunkmeta adds to vLLM's model runners,
and the decision per step, taken where vLLM takes it (its dispatch, before any ``build()``).

Under ``FULL_AND_PIECEWISE`` (vLLM's default) vLLM captures FULL graphs for decode-only batches
and piecewise ones for mixed batches. With ``CHUNKMETA_VLLM_FULL_GRAPH=1`` chunkmeta adds FULL
graphs for mixed batches of every capture size ``N > 1``, beside vLLM's decode graphs:

* Model Runner V2 (vLLM 0.33.0's default, ``v1/worker/gpu``): descriptors ``(FULL, N, R)`` for
  ``R`` in ``request_buckets(N, max_num_seqs)`` (powers of two from 8, then vLLM's own
  ``min(N, max_num_seqs)``), placed after vLLM's FULL decode descriptors and before the piecewise
  ones in the manager's ordered candidates, so a batch of ``r`` requests replays the graph of
  the smallest ``R >= r``: at most twice its rows, where vLLM's key alone pads every mixed batch
  to ``min(N, max_num_seqs)`` rows, each carrying a recurrent state through every layer.
* V1 (``v1/worker/gpu_model_runner.py``, deprecated): vLLM's own keys ``(N, min(N,
  max_num_seqs))`` (its dispatcher is not told the request count).

Under a user's ``cudagraph_mode=FULL`` the mixed graphs are vLLM's own; each gets its bucket
before capture, or leaves the capture list (its steps run eagerly). Under vLLM's breakable
graphs (Kimi-Linear, where MLA keeps mixed steps off FULL graphs), MRV2's piecewise graphs get
buckets instead (``chunkmeta.integrations.vllm.breakable``).

The decision: ``MixedDispatch`` wraps the runner's dispatch. When vLLM picks a mixed FULL graph
(``mrv2_mixed_shape`` / ``v1_mixed_shape``) the step must be one chunkmeta can stage
(``MixedDispatch.cannot_stage``); if not, it takes the graph vLLM would take without
chunkmeta's (MRV2: the next compatible candidate; V1: piecewise), one warning per cause,
counted. The builders read the decision in ``build()``: they stage exactly the steps dispatched
to a mixed graph, so no graph replays inputs that were not staged for it.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from itertools import product
from typing import NamedTuple

from chunkmeta.integrations.vllm.interface import logger

# "0": MRV2's mixed graphs at vLLM's own request capacity only, min(N, max_num_seqs) (fewer graphs
# to capture, every padded row carried): the comparison the request buckets have to win
REQUEST_BUCKETS_ENV = "CHUNKMETA_VLLM_REQUEST_BUCKETS"
MRV2_RUNNER_MODULE = "vllm.v1.worker.gpu.model_runner"
V1_RUNNER_MODULE = "vllm.v1.worker.gpu_model_runner"
RUNNER = "GPUModelRunner"
SMALLEST_REQUEST_BUCKET = 8  # below it more graphs would save a few padded rows (not measured)


def request_buckets(num_tokens: int, max_num_reqs: int, environ=None) -> list[int]:
    """The request capacities of the mixed graphs of ``num_tokens`` tokens, ascending: powers of
    two from ``SMALLEST_REQUEST_BUCKET`` below vLLM's ``min(num_tokens, max_num_reqs)``, then it
    (it alone with ``CHUNKMETA_VLLM_REQUEST_BUCKETS=0``)."""
    top = min(num_tokens, max_num_reqs)
    if (os.environ if environ is None else environ).get(REQUEST_BUCKETS_ENV, "1").strip() == "0":
        return [top]
    out, r = [], SMALLEST_REQUEST_BUCKET
    while r < top:
        out.append(r)
        r *= 2
    return [*out, top]


class MixedDispatch:
    """The mixed graph vLLM's dispatch chose for the step in flight (``current``: its
    ``(num_tokens, num_reqs)``, None for any other graph or none), shared by the runner's
    chunkmeta builders; the steps turned away from a mixed graph, by cause.

    A mixed graph is a FULL one (``added`` or vLLM's own) or, under vLLM's breakable CUDA graphs,
    a piecewise one whose KDA layers chunkmeta's bucket keeps in the graph (``breakable``,
    ``chunkmeta.integrations.vllm.breakable``). Each decision and each capture is a new
    ``stage_id``; a builder that staged it (or its KV-cache group's view) is marked with it
    (``mark``), so a replay can tell that every builder staged the step in flight
    (``fully_staged``)."""

    def __init__(self, builders):
        self.builders = list(builders)
        self.current: tuple[int, int] | None = None
        self.added: set[tuple[int, int]] = set()  # the mixed graphs chunkmeta added beside vLLM's
        self.breakable = set()  # vLLM's breakable graphs holding chunkmeta's KDA
        self.refused: set[tuple[int, int]] = set()  # graphs whose capture chunkmeta could not stage
        self.turned_away: dict[str, int] = {}
        self.captures: list[dict] = []  # the last capture's graphs, each timed (mrv2_capture)
        # the step in flight's scheduler output (record_steps); its rows (``step``) are counted
        # only where a builder asks for them (a Mamba2 graph of few SSD rows)
        self._scheduler_output = None
        self._step: StepRows | None = None
        self._step_read = True
        self.stage_id = 0
        self._marks: dict[int, int] = {}  # id(builder) -> the stage_id it last staged
        for builder in self.builders:
            builder._chunkmeta_dispatch = self

    @property
    def breakable(self) -> set[tuple[int, int]]:
        return self._breakable

    @breakable.setter
    def breakable(self, shapes) -> None:
        # set once at start-up; each dispatch reads its size's rows from the index, not the set
        self._breakable = set(shapes)
        self.breakable_rows: dict[int, list[int]] = {}  # N -> its buckets' request rows, ascending
        for n, r in sorted(self._breakable):
            self.breakable_rows.setdefault(n, []).append(r)

    @property
    def step(self) -> StepRows | None:
        """The step in flight's rows (``StepRows``), counted on first read; None outside a step."""
        if not self._step_read:
            self._step, self._step_read = StepRows.of(self._scheduler_output), True
        return self._step

    @step.setter
    def step(self, rows: StepRows | None) -> None:
        self._step, self._step_read = rows, True

    @property
    def in_step(self) -> bool:
        """Whether a step is in flight (``record_steps``: MRV2's ``execute_model`` runs)."""
        return self._scheduler_output is not None

    def begin_step(self, scheduler_output) -> None:
        self._scheduler_output, self._step, self._step_read = scheduler_output, None, scheduler_output is None

    def end_step(self) -> None:
        """The step's decision ends with it: a build outside a step stages nothing."""
        self.begin_step(None)
        self.current = None
        self.stage_id += 1

    def mark(self, builder) -> None:
        """``builder`` staged the step in flight (its bucket, or its group's view)."""
        self._marks[id(builder)] = self.stage_id

    def fully_staged(self) -> bool:
        """Whether every builder staged the step in flight."""
        return all(self._marks.get(id(b)) == self.stage_id for b in self.builders)

    def prepare_capture(self, shape: tuple[int, int] | None) -> None:
        """A capture's inputs are about to be built: ``shape``, a breakable graph's, is staged
        by the builders (None: no breakable graph; FULL captures stage through
        ``build_for_cudagraph_capture``)."""
        self.stage_id += 1
        self.current = shape if shape in self.breakable else None

    def decide(self, shape: tuple[int, int] | None, *, uniform_decode: bool = False) -> bool:
        """Record vLLM's choice for this step: ``shape`` of a mixed graph, or None. False
        when the step does not go there: it cannot be staged, or it is a uniform decode batch
        that reached a graph chunkmeta added (where vLLM has no decode graph of that size: its
        own choice without chunkmeta's graphs keeps its decode kernels). The caller then
        dispatches the step elsewhere."""
        self.current = None
        self.stage_id += 1
        if shape is None:
            return True
        if uniform_decode and shape in self.added:
            return False
        why = self.cannot_stage(shape) or next(
            (w for b in self.builders if (w := b.chunkmeta_refuses(shape, self)) is not None), None
        )
        if why is not None:
            self._turn_away(why)
            return False
        self.current = shape
        return True

    def cannot_stage(self, shape: tuple[int, int]) -> str | None:
        """Why a step of a mixed graph of ``shape`` cannot be staged, or None. Host-only checks,
        every one a ``stage()`` would fail on for any batch of that graph."""
        if not self._active():
            return "a chunkmeta builder serves no mixed step"
        if shape in self.refused or not any(shape in b.chunkmeta_buckets for b in self.builders):
            return "a mixed graph captured without chunkmeta's inputs"
        return None

    def _active(self) -> bool:
        return all(b._mixed_active() for b in self.builders)

    def refuse(self, shape: tuple[int, int]) -> None:
        """No step goes to the mixed graph of ``shape`` (its capture could not be staged)."""
        self.refused.add(shape)

    def stageable(self, shapes, vllm_config) -> set:
        """Of vLLM's own mixed graphs (``cudagraph_mode=FULL``), those every chunkmeta builder can
        stage, each bucket made now (before capture): the others are to be removed (all of them
        with KV-sharing fast prefill, with one warning)."""
        why = fast_prefill_refusal(vllm_config)
        if why:
            logger.warning("chunkmeta: no mixed-step graphs: %s", why)
            return set()
        if not self._active():
            return set()
        return make_buckets(self.builders, shapes, self._turn_away)

    def _turn_away(self, why: str) -> None:
        count = self.turned_away[why] = self.turned_away.get(why, 0) + 1
        if count == 1:
            logger.warning("chunkmeta: a step stays off the mixed-step graphs: %s", why)


def make_buckets(builders, shapes, turn_away) -> set:
    """Of ``shapes``, those whose bucket every builder makes (made now); each other one's cause to
    ``turn_away`` (that graph is not captured: its steps take vLLM's path)."""
    kept = set()
    for shape in shapes:
        try:
            for builder in builders:
                builder.chunkmeta_bucket(*shape)
        except Exception as exc:  # noqa: BLE001  (a bucket over its memory budget, a layout it cannot make)
            turn_away(f"no bucket for a mixed graph ({type(exc).__name__}: {exc})")
        else:
            kept.add(shape)
    return kept


def mixed_full_eligible(vllm_config, attn_groups, builders) -> str | None:
    """Why a runner under ``FULL_AND_PIECEWISE`` gets no mixed FULL graph from chunkmeta, or None.
    Every group's builder must support ``ALWAYS`` and every chunkmeta builder serve mixed steps;
    one data parallel rank (ranks pad to the largest batch after agreeing on a mode: a decode
    rank would find no graph of a mixed size), no micro-batching (its graphs are keyed by token
    count alone), no KV-sharing fast prefill (``fast_prefill_refusal``)."""
    from vllm.v1.attention.backend import AttentionCGSupport

    parallel = vllm_config.parallel_config
    if parallel.data_parallel_size > 1 or parallel.use_ubatching:
        return "data parallelism or micro-batching"
    why = fast_prefill_refusal(vllm_config)
    if why is not None:
        return why
    if not builders or not all(b._mixed_active() for b in builders):
        return "a GDN-family builder that serves no mixed step"
    for group in attn_groups:
        support = group.backend.get_builder_cls().get_cudagraph_support(vllm_config, group.kv_cache_spec)
        if support != AttentionCGSupport.ALWAYS:
            return f"{group.backend.__name__} supports {support.name} CUDA graphs, not ALWAYS"
    return None


def fast_prefill_refusal(vllm_config) -> str | None:
    """KV-sharing fast prefill dispatches a second, logits-sized batch inside a step (MRV2
    attn_utils.py:123, V1 gpu_model_runner.py:2681), which would overwrite the step's decision."""
    if getattr(vllm_config.cache_config, "kv_sharing_fast_prefill", False):
        return "KV-sharing fast prefill"
    return None


def _chunkmeta_builders(attn_groups) -> list:
    from chunkmeta.integrations.vllm.full_graph import FullGraphBuilderMixin

    return [b for group in attn_groups for b in group.metadata_builders if isinstance(b, FullGraphBuilderMixin)]


# -- Model Runner V2 -------------------------------------------------------------------------------


def mrv2_mixed_shape(desc) -> tuple[int, int] | None:
    """``(num_tokens, num_reqs)`` of a mixed FULL descriptor (vLLM's under ``cudagraph_mode=FULL``
    or chunkmeta's), None for any other (decode, piecewise, none)."""
    from vllm.config.compilation import CUDAGraphMode

    if desc.cg_mode != CUDAGraphMode.FULL or desc.uniform_token_count is not None or desc.max_query_len is not None:
        return None
    return desc.num_tokens, desc.num_reqs


def mrv2_breakable_shape(manager, desc, record: MixedDispatch, num_reqs: int | None = None) -> tuple[int, int] | None:
    """The breakable graph with chunkmeta's KDA (``record.breakable``) a piecewise descriptor
    stands for, ``(num_tokens, request rows)``, or None (no such graph of its size). A
    capture-only descriptor names its rows (``breakable.add_breakable_buckets``); vLLM's own
    (``num_reqs`` None: its capture's ``min(N, max_num_seqs)`` rows, cudagraph_utils.py:676)
    stands, for a step of ``num_reqs`` requests, for the smallest graph of its size holding
    them that is not refused, else for that size's largest (refused: the dispatch turns the
    step away)."""
    from vllm.config.compilation import CUDAGraphMode

    if not getattr(manager, "use_breakable_cg", False) or desc.cg_mode != CUDAGraphMode.PIECEWISE:
        return None
    n = desc.num_tokens
    if desc.num_reqs is not None:
        return (n, desc.num_reqs) if (n, desc.num_reqs) in record.breakable else None
    rows = record.breakable_rows.get(n)
    if not rows:
        return None
    held = [r for r in rows if r >= (num_reqs or rows[-1]) and (n, r) not in record.refused]
    return (n, held[0] if held else rows[-1])


CAPTURE_MODULE = "vllm.v1.worker.gpu.cudagraph_utils"
CAPTURE_MANAGER = "CudaGraphManager"


def _free_bytes(device) -> int:
    """The device's free memory, after a synchronize (start-up only, between two captures)."""
    import torch

    torch.cuda.synchronize(device)
    return torch.cuda.mem_get_info(device)[0]


def mrv2_capture(original):
    """MRV2's ``CudaGraphManager.capture`` (the loop ``ModelCudaGraphManager.capture`` runs
    through ``super()``) for a manager chunkmeta's start-up hooked (its ``_chunkmeta_record``, a
    ``MixedDispatch``): before each descriptor's inputs are built, the record says which
    breakable graph they are for (``prepare_capture``: the builders stage it); where start-up
    asked for it (``_chunkmeta_timed``: a CUDA device), each graph is timed: per descriptor the
    seconds of its warm-up and capture and the device memory they took. ``record.captures`` is
    the last capture's list (vLLM's memory profile captures a sample first), chunkmeta's mixed
    graphs marked ``chunkmeta``."""

    @functools.wraps(original)
    def capture(self, create_forward_fn, *args, **kwargs):
        record = getattr(self, "_chunkmeta_record", None)
        if record is None:
            return original(self, create_forward_fn, *args, **kwargs)
        timed = getattr(self, "_chunkmeta_timed", False)
        rows, current = [], []

        def close():
            if current:
                desc, t0, free0 = current.pop()
                shape = mrv2_mixed_shape(desc)
                ours = (shape is not None and shape in record.added) or mrv2_breakable_shape(self, desc, record)
                rows.append(
                    {
                        "mode": getattr(desc.cg_mode, "name", str(desc.cg_mode)),
                        "num_tokens": desc.num_tokens,
                        "num_reqs": desc.num_reqs,
                        "chunkmeta": bool(ours),
                        "seconds": round(time.perf_counter() - t0, 4),
                        "bytes": free0 - _free_bytes(self.device),
                    }
                )

        def create(desc, *fn_args, **fn_kwargs):
            # vLLM asks for each descriptor's warm-up forward first (warmup=True), then its capture
            if timed and fn_kwargs.get("warmup", fn_args[0] if fn_args else False):
                close()
                current.append((desc, time.perf_counter(), _free_bytes(self.device)))
            record.prepare_capture(mrv2_breakable_shape(self, desc, record))
            return create_forward_fn(desc, *fn_args, **fn_kwargs)

        try:
            return original(self, create, *args, **kwargs)
        finally:
            record.current = None  # no step is in flight after a capture
            if timed:
                # after a failed capture the synchronize may fail too: the capture's error is the one raised
                with contextlib.suppress(Exception):
                    close()
                record.captures = rows

    capture.__qualname__ = f"chunkmeta.{CAPTURE_MANAGER}.capture"
    return capture


def add_mixed_full_descs(manager, vllm_config, builders, turn_away) -> set[tuple[int, int]]:
    """Under ``FULL_AND_PIECEWISE``, MRV2 descriptors ``(FULL, N, R)`` for mixed batches (module
    docstring), each bucket made first: a shape whose bucket cannot be made gets no descriptor,
    its cause to ``turn_away`` (``MixedDispatch._turn_away``). Returns the shapes added."""
    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.worker.gpu.cudagraph_utils import BatchExecutionDescriptor

    if manager.cudagraph_mode != CUDAGraphMode.FULL_AND_PIECEWISE:
        return set()
    full = manager._capture_descs.get(CUDAGraphMode.FULL, [])
    sizes = sorted({d.num_tokens for d in manager._capture_descs.get(CUDAGraphMode.PIECEWISE, ()) if d.num_tokens > 1})
    wanted = [
        desc
        for loras, n in product(manager.lora_capture_cases, sizes)
        for r in request_buckets(n, manager.max_num_reqs)
        if (desc := BatchExecutionDescriptor(CUDAGraphMode.FULL, n, r, num_active_loras=loras)) not in full
    ]
    made = make_buckets(builders, {(d.num_tokens, d.num_reqs) for d in wanted}, turn_away)
    added = [d for d in wanted if (d.num_tokens, d.num_reqs) in made]
    # candidates: a batch of i tokens tries the FULL descriptors of the smallest size >= i first
    # (vLLM's decode ones, which take only decode batches), then these, smallest R first, then
    # the piecewise ones
    # (every new list made before any is set: a failure leaves vLLM's lists as they were)
    lists = {}
    for (i, loras), candidates in manager._candidates.items():
        size = next((n for n in sizes if n >= i), None)
        ours = [d for d in added if d.num_tokens == size and d.num_active_loras == loras]
        if ours:
            at = next((k for k, d in enumerate(candidates) if d.cg_mode != CUDAGraphMode.FULL), len(candidates))
            lists[i, loras] = [*candidates[:at], *ours, *candidates[at:]]
    # capture order, largest first as vLLM's: per size the mixed graphs before vLLM's decode one,
    # most requests first. vLLM's memory profile captures the first two FULL graphs and counts
    # the rest at the second's cost (cudagraph_utils.py:995-1039): the heaviest must be sampled
    # (H100, Qwen3.5: 0.43 GiB estimated, 1.89 GiB taken, with vLLM's decode graph first)
    ours = {id(d) for d in added}
    descs = sorted([*full, *added], key=lambda d: (d.num_tokens, id(d) in ours, d.num_reqs or 0), reverse=True)
    for key, candidates in lists.items():
        manager._candidates[key][:] = candidates
    manager._capture_descs[CUDAGraphMode.FULL] = descs
    return {(d.num_tokens, d.num_reqs) for d in added}


def keep_stageable_descs(manager, record: MixedDispatch) -> int:
    """Under ``cudagraph_mode=FULL``: vLLM's own mixed descriptors whose bucket cannot be made
    (or with KV-sharing fast prefill, all of them) leave the capture list and the candidates, so
    no capture reaches vLLM's decode-only capture path and their steps run eagerly. Returns the
    descriptors removed."""
    from vllm.config.compilation import CUDAGraphMode

    full = manager._capture_descs.get(CUDAGraphMode.FULL, [])
    kept = record.stageable({shape for d in full if (shape := mrv2_mixed_shape(d)) is not None}, manager.vllm_config)

    def keep(d):
        shape = mrv2_mixed_shape(d)
        return shape is None or shape in kept

    removed = len(full) - sum(map(keep, full))
    if removed:
        manager._capture_descs[CUDAGraphMode.FULL] = [d for d in full if keep(d)]
        for candidates in manager._candidates.values():
            candidates[:] = [d for d in candidates if keep(d)]
    return removed


def mrv2_dispatch(manager, record: MixedDispatch) -> None:
    """Wrap ``manager.dispatch`` (this instance): vLLM's choice, recorded; a mixed graph (FULL, or
    breakable holding chunkmeta's KDA) a builder cannot stage gives way to the next compatible
    candidate that is not one (none for a breakable one: the step runs eagerly)."""
    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.worker.gpu.cudagraph_utils import BatchExecutionDescriptor, _is_compatible

    original = manager.dispatch

    def mixed_shape(desc, num_reqs=None):
        return mrv2_mixed_shape(desc) or mrv2_breakable_shape(manager, desc, record, num_reqs)

    @functools.wraps(original)
    def dispatch(num_reqs, num_tokens, uniform_token_count, num_active_loras, max_query_len=None, num_ubatches=1):
        desc = original(num_reqs, num_tokens, uniform_token_count, num_active_loras, max_query_len, num_ubatches)
        uniform_decode = uniform_token_count is not None and uniform_token_count == manager.decode_query_len
        if record.decide(mixed_shape(desc, num_reqs), uniform_decode=uniform_decode):
            return desc
        loras = manager._resolve_effective_loras(num_active_loras)
        for other in manager._candidates.get((num_tokens, loras), ()):
            if mixed_shape(other) is None and _is_compatible(
                other, num_reqs, num_tokens, uniform_token_count, loras, max_query_len, num_ubatches
            ):
                return other
        return BatchExecutionDescriptor(
            CUDAGraphMode.NONE, num_tokens, num_reqs, num_active_loras=loras, num_ubatches=num_ubatches
        )

    manager.dispatch = dispatch


class StepRows(NamedTuple):
    """A step's rows as the scheduler gave them: ``scheduled`` tokens per request id, in the
    scheduler's order, and each request's ``computed`` tokens before the step (where known)."""

    scheduled: dict[str, int]
    computed: dict[str, int]

    @classmethod
    def of(cls, scheduler_output) -> StepRows | None:
        scheduled = getattr(scheduler_output, "num_scheduled_tokens", None)
        if not isinstance(scheduled, dict):
            return None
        computed = {r.req_id: r.num_computed_tokens for r in getattr(scheduler_output, "scheduled_new_reqs", ())}
        cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
        if cached is not None:
            computed.update(zip(cached.req_ids, cached.num_computed_tokens, strict=False))
        return cls(scheduled, computed)


def record_steps(runner, record: MixedDispatch) -> None:
    """``runner.execute_model`` (this instance; wrapped once, the latest record read per call)
    marks the step in flight on ``record`` while it runs (its rows, ``StepRows``, counted where
    asked: 13 us a step at 256 requests on the CPU machine, not paid by every step): Model
    Runner V2 dispatches inside it, its dummy runs included (gpu/model_runner.py:920, 1799-1844)."""
    runner._chunkmeta_record = record
    if getattr(runner, "_chunkmeta_steps_recorded", False):
        return
    original = runner.execute_model

    @functools.wraps(original)
    def execute_model(*args, **kwargs):
        current = runner._chunkmeta_record
        current.begin_step(args[0] if args else kwargs.get("scheduler_output"))
        try:
            return original(*args, **kwargs)
        finally:
            current.end_step()

    runner.execute_model = execute_model
    runner._chunkmeta_steps_recorded = True


def _breakable_buckets(vllm_config, manager, builders, record: MixedDispatch) -> None:
    """Under vLLM's breakable graphs, chunkmeta's KDA in them (``breakable``), or a log line why not."""
    from chunkmeta.integrations.vllm import breakable

    why = breakable.breakable_refusal(vllm_config, manager, builders)
    if why is not None:
        logger.info("chunkmeta: breakable graphs keep vLLM's KDA breaks: %s", why)
        return
    shapes = breakable.add_breakable_buckets(manager, builders, record)
    breakable.gate(manager, record)
    logger.info("chunkmeta: %d breakable CUDA graphs hold chunkmeta's KDA (MLA stays a break)", len(shapes))


def mrv2_mixed_graphs(original):
    """MRV2's ``GPUModelRunner.initialize_kv_cache`` (it makes the builders and the graph manager,
    nothing captured yet), then the mixed graphs (chunkmeta's beside vLLM's under
    ``FULL_AND_PIECEWISE``; vLLM's own under ``FULL``, each with its bucket) and the dispatch
    decision. A failure keeps vLLM's descriptors, with one warning."""
    from vllm.config.compilation import CUDAGraphMode

    @functools.wraps(original)
    def initialize_kv_cache(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        manager = getattr(self, "cudagraph_manager", None)
        groups = [g for gs in self.attn_groups for g in gs]
        builders = _chunkmeta_builders(groups)
        if manager is None or not builders:
            return result
        record = MixedDispatch(builders)
        try:
            if manager.cudagraph_mode == CUDAGraphMode.FULL_AND_PIECEWISE:
                why = mixed_full_eligible(self.vllm_config, groups, builders)
                why = why or ("micro-batching" if manager.ubatch_runner is not None else None)
                if why:
                    logger.info("chunkmeta: mixed batches stay piecewise: %s", why)
                    _breakable_buckets(self.vllm_config, manager, builders, record)
                else:
                    record.added = add_mixed_full_descs(manager, self.vllm_config, builders, record._turn_away)
                    logger.info("chunkmeta: %d FULL CUDA graphs for mixed batches beside vLLM's", len(record.added))
            elif manager.cudagraph_mode.mixed_mode() == CUDAGraphMode.FULL:
                keep_stageable_descs(manager, record)
        except Exception as exc:  # noqa: BLE001  vLLM's descriptors as they were: mixed batches piecewise
            record.added, record.breakable = set(), set()
            logger.warning("chunkmeta: no mixed-step graphs added (%s: %s)", type(exc).__name__, exc)
        mrv2_dispatch(manager, record)
        record_steps(self, record)
        manager._chunkmeta_record = record  # mrv2_capture: breakable captures staged
        manager._chunkmeta_timed = getattr(getattr(manager, "device", None), "type", None) == "cuda"
        return result

    initialize_kv_cache.__qualname__ = f"chunkmeta.{RUNNER}.initialize_kv_cache"
    return initialize_kv_cache


# -- V1 --------------------------------------------------------------------------------------------


def v1_mixed_shape(mode, key) -> tuple[int, int] | None:
    from vllm.config.compilation import CUDAGraphMode

    return (key.num_tokens, key.num_reqs) if mode == CUDAGraphMode.FULL and not key.uniform else None


def add_mixed_full_keys(dispatcher, vllm_config, attn_groups, turn_away) -> set[tuple[int, int]]:
    """Under ``FULL_AND_PIECEWISE``, V1 FULL keys for mixed batches, the ones
    ``cudagraph_mode=FULL`` would have (vLLM's ``_create_padded_batch_descriptor``: ``(size,
    min(size, max_num_seqs))``, not uniform); the dispatcher checks FULL keys before piecewise
    ones (cudagraph_dispatcher.py:315-320). None unless ``mixed_full_eligible``; every key's
    bucket made before any key is added, a key whose bucket cannot be made left out, its cause to
    ``turn_away``. Returns the shapes added."""
    from vllm.config.compilation import CUDAGraphMode

    if dispatcher.cudagraph_mode != CUDAGraphMode.FULL_AND_PIECEWISE:
        return set()
    builders = _chunkmeta_builders(attn_groups)
    why = mixed_full_eligible(vllm_config, attn_groups, builders)
    if why is not None:
        logger.info("chunkmeta: mixed batches stay piecewise: %s", why)
        return set()
    sizes = [s for s in vllm_config.compilation_config.cudagraph_capture_sizes or () if s > 1]
    keys = {
        dispatcher._create_padded_batch_descriptor(size, False, loras > 0, loras)
        for size, loras in product(sizes, dispatcher._get_lora_cases())
    } - dispatcher.cudagraph_keys[CUDAGraphMode.FULL]
    made = make_buckets(builders, {(key.num_tokens, key.num_reqs) for key in keys}, turn_away)
    keys = {key for key in keys if (key.num_tokens, key.num_reqs) in made}
    for key in keys:
        dispatcher.add_cudagraph_key(CUDAGraphMode.FULL, key)
    logger.info("chunkmeta: %d FULL CUDA graph keys for mixed batches beside vLLM's FULL decode graphs", len(keys))
    return {(key.num_tokens, key.num_reqs) for key in keys}


def keep_stageable_keys(dispatcher, vllm_config, record: MixedDispatch) -> int:
    """Under ``cudagraph_mode=FULL``: vLLM's own mixed keys whose bucket cannot be made (or with
    KV-sharing fast prefill, all of them) are removed before capture; their steps run eagerly.
    Returns the keys removed."""
    from vllm.config.compilation import CUDAGraphMode

    keys = dispatcher.cudagraph_keys[CUDAGraphMode.FULL]
    mixed = {key for key in keys if not key.uniform}
    kept = record.stageable({(k.num_tokens, k.num_reqs) for k in mixed}, vllm_config)
    gone = {key for key in mixed if (key.num_tokens, key.num_reqs) not in kept}
    keys -= gone
    return len(gone)


def v1_dispatch(dispatcher, record: MixedDispatch) -> None:
    """Wrap ``dispatcher.dispatch`` (this instance): vLLM's choice, recorded; a mixed FULL key a
    builder cannot stage gives way to vLLM's dispatch without FULL graphs."""
    from vllm.config.compilation import CUDAGraphMode
    from vllm.forward_context import BatchDescriptor

    original = dispatcher.dispatch

    @functools.wraps(original)
    def dispatch(num_tokens, uniform_decode=False, has_lora=False, num_active_loras=0, valid_modes=None, **kwargs):
        mode, key = original(num_tokens, uniform_decode, has_lora, num_active_loras, valid_modes, **kwargs)
        if record.decide(v1_mixed_shape(mode, key)):
            return mode, key
        invalid = {*(kwargs.pop("invalid_modes", None) or ()), CUDAGraphMode.FULL}
        if not (valid_modes or CUDAGraphMode.valid_runtime_modes()) - invalid:
            return CUDAGraphMode.NONE, BatchDescriptor(num_tokens)  # only FULL was allowed: eager
        return original(num_tokens, uniform_decode, has_lora, num_active_loras, valid_modes, invalid_modes=invalid)

    dispatcher.dispatch = dispatch


def v1_mixed_graphs(original):
    """V1's ``GPUModelRunner.initialize_metadata_builders`` (vLLM has settled the mode and its
    keys, and made the builders), then the mixed keys (chunkmeta's beside vLLM's under
    ``FULL_AND_PIECEWISE``; vLLM's own under ``FULL``, each with its bucket) and the dispatch
    decision. A failure keeps vLLM's keys, with one warning."""
    from vllm.config.compilation import CUDAGraphMode

    @functools.wraps(original)
    def initialize_metadata_builders(self, *args, **kwargs):
        original(self, *args, **kwargs)
        groups = [g for gs in self.attn_groups for g in gs]
        builders = _chunkmeta_builders(groups)
        if not builders:
            return
        dispatcher = self.cudagraph_dispatcher
        record = MixedDispatch(builders)
        try:
            if dispatcher.cudagraph_mode == CUDAGraphMode.FULL_AND_PIECEWISE:
                record.added = add_mixed_full_keys(dispatcher, self.vllm_config, groups, record._turn_away)
            elif dispatcher.cudagraph_mode.mixed_mode() == CUDAGraphMode.FULL:
                keep_stageable_keys(dispatcher, self.vllm_config, record)
        except Exception as exc:  # noqa: BLE001  vLLM's keys as it made them: mixed batches piecewise
            logger.warning("chunkmeta: no FULL graphs for mixed batches (%s: %s)", type(exc).__name__, exc)
        v1_dispatch(dispatcher, record)

    initialize_metadata_builders.__qualname__ = f"chunkmeta.{RUNNER}.initialize_metadata_builders"
    return initialize_metadata_builders
