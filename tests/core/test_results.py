"""The step build's result objects (chunkmeta.results): the C executor makes exactly the objects
the Python executor makes from the same recipe, and refuses a recipe it cannot run."""

import copy

import attrs
import numpy as np
import pytest
import torch

from chunkmeta import StepTablesBuilder, native
from chunkmeta import results as R
from strategies import STEP_SPECS, STEP_SPECS_B, random_step

MAX_SEQS, MAX_TOKENS = 24, 1500
module = native.module()
needs_native = pytest.mark.skipif(module is None, reason="the C host build does not load here")


def same_value(a, b, where):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert (a.data_ptr(), a.shape, a.stride(), a.dtype, a.device) == (
            b.data_ptr(),
            b.shape,
            b.stride(),
            b.dtype,
            b.device,
        ), where
    else:
        assert type(a) is type(b) and a == b, (where, a, b)


def assert_same_objects(c_step, py_step):
    assert type(c_step) is type(py_step)
    assert c_step.names == py_step.names
    for field in ("padded", "generation", "_lease", "_slot"):
        same_value(getattr(c_step, field), getattr(py_step, field), field)
    for step in (c_step, py_step):  # the tables are the instance __dict__: step.<name> is a plain lookup
        assert step.__dict__ is step._tables
        assert all(getattr(step, name) is step[name] for name in step.names)
    for name in c_step.names:
        a, b = c_step[name], py_step[name]
        assert type(a) is type(b), name
        for field in attrs.fields(type(a)):
            same_value(getattr(a, field.name), getattr(b, field.name), (name, field.name))


class Recorder:
    """Wraps a builder's executors to keep each build's arguments."""

    def __init__(self, builder):
        self.calls = []
        for padded, make in list(builder._results.items()):
            builder._results[padded] = self.wrap(make, padded)

    def wrap(self, make, padded):
        def recorded(*args):
            self.calls.append((padded, args))
            return make(*args)

        return recorded


def build_random(builder, rng, padded=False):
    """One build of a random step (CPU tensors: the host copies stand in for the device's)."""
    qsl, first, n, computed, checkpoints = random_step(rng, MAX_SEQS, MAX_TOKENS)
    qsl_cpu = torch.tensor(qsl, dtype=torch.int32)
    rows = {"num_computed_tokens": torch.tensor(computed, dtype=torch.int32)}
    rows["num_computed_tokens_cpu"] = rows["num_computed_tokens"]
    if builder.needs_checkpoints:
        rows["checkpoint_offsets"] = rows["checkpoint_offsets_cpu"] = torch.tensor(checkpoints, dtype=torch.int32)
    return builder.build(qsl_cpu, qsl_cpu, first_seq=first, num_seqs=n, padded=padded, **rows)


@needs_native
@pytest.mark.parametrize("specs", [STEP_SPECS, STEP_SPECS_B], ids=["a", "b"])
@pytest.mark.parametrize("limit", [None, 12], ids=["cache", "small-cache"])
def test_c_results_equal_python_results(specs, limit, monkeypatch):
    if limit:  # views made again after the cache is cleared
        monkeypatch.setattr("chunkmeta.ring.VIEW_CACHE_LIMIT", limit)
    builder = StepTablesBuilder(MAX_SEQS, MAX_TOKENS, tables=specs, device="cpu", backend="torch", ring_depth=3)
    # the Python executor makes its views with make_view into a cache of its own, so every view
    # the C executor makes on a miss (its own slice of view_base) is compared with make_view's
    shadow = copy.copy(builder.ring)
    shadow.views = {}
    python = {
        padded: R.python_results(
            R.step_recipe(specs, builder.layout, padded, builder._fla_seqs_pad, builder.pad, builder.capacity.seqs),
            shadow.views,
            shadow.make_view,
            builder.ring,
        )
        for padded in (False, True)
    }
    recorder = Recorder(builder)
    for i in range(60):
        # windows of 12 builds over the three slots: three steps twice in the exact layout, so each
        # slot sees its step again (the C executor's per-slot memo of each field's last view), then
        # the same in the padded layout; each window brings three new steps
        seed, padded = 7 + 3 * (i // 12) + i % 3, i % 12 >= 6
        c_step = build_random(builder, np.random.default_rng(seed), padded=padded)
        padded, args = recorder.calls[-1]
        py_step = python[padded](*args)
        assert_same_objects(c_step, py_step)
        # FLA memoizes by identity: every build hands out new cu_seqlens objects
        fla = [name for name in c_step.names if hasattr(c_step[name], "cu_seqlens_cpu")]
        for name in fla:
            assert c_step[name].cu_seqlens is not py_step[name].cu_seqlens
            assert c_step[name].cu_seqlens_cpu is not py_step[name].cu_seqlens_cpu


@needs_native
@pytest.mark.parametrize("slot", [np.int64(1), 1.0, True, -1, 2**70, "x"], ids=repr)
def test_executors_agree_on_a_slot_that_is_not_a_ring_index(slot):
    # the C executor uses its memo and bases for the ring's slots only, and leaves anything else
    # to make_view as the Python executor does: the same objects or the same exception
    builder = StepTablesBuilder(MAX_SEQS, MAX_TOKENS, tables=STEP_SPECS_B, device="cpu", backend="torch")
    build_random(builder, np.random.default_rng(3))  # fills the view cache the executors share
    counts, facts = _plan_of(builder, np.random.default_rng(3))
    recipe = R.step_recipe(
        STEP_SPECS_B, builder.layout, False, builder._fla_seqs_pad, builder.pad, builder.capacity.seqs
    )
    made = {}
    for name, make in (
        ("c", builder._results[False]),
        ("python", R.python_results(recipe, builder.ring.views, builder.ring.make_view, builder.ring)),
    ):
        try:
            made[name] = make(slot, 5, counts, facts)
        except Exception as exc:  # noqa: BLE001 - compared by type below
            made[name] = type(exc)
    if isinstance(made["c"], type):
        assert made["c"] is made["python"], made
    else:
        assert_same_objects(made["c"], made["python"])


def _plan_of(builder, rng):
    """The counts and facts of the step build_random(builder, rng) builds."""
    recorder = Recorder(builder)
    build_random(builder, rng)
    return recorder.calls[-1][1][2:]


@needs_native
@pytest.mark.parametrize(
    "field, error",
    [
        ((99,), ValueError),  # no such op
        ((R.ITEM, 5, 0), ValueError),  # no such source
        ((R.VIEW, 0, 3, False, R.COUNTS, 0, 0, R.ALWAYS), ValueError),  # no such shape
        ((R.TABLES,), ValueError),  # only the StepTables holds the tables
        ("not a tuple", TypeError),
    ],
)
def test_make_results_refuses_a_bad_recipe(field, error):
    builder = StepTablesBuilder(MAX_SEQS, MAX_TOKENS, tables=STEP_SPECS_B, device="cpu", backend="torch")
    outputs, (top_cls, top_fields) = R.step_recipe(
        STEP_SPECS_B, builder.layout, False, builder._fla_seqs_pad, builder.pad, builder.capacity.seqs
    )
    name, cls, fields = outputs[0]
    bad = (name, cls, R._descriptors(cls), (field, *fields[1:]))
    top = (top_cls, R._descriptors(top_cls), top_fields)
    with pytest.raises(error):
        ring = builder.ring
        module.make_results((bad,), top, ring.views, ring.make_view, ring.view_base, ring.depth, ring.view_limit, ring)


@needs_native
def test_c_views_keep_the_cache_limit(monkeypatch):
    # the C executor puts the views it makes in the ring's cache and clears it at the ring's
    # limit, as make_view does: an engine's steps bring ever new row counts
    monkeypatch.setattr("chunkmeta.ring.VIEW_CACHE_LIMIT", 9)
    builder = StepTablesBuilder(MAX_SEQS, MAX_TOKENS, tables=STEP_SPECS, device="cpu", backend="torch")
    rng = np.random.default_rng(11)
    sizes = []
    for _ in range(40):
        build_random(builder, rng)
        sizes.append(len(builder.ring.views))
    assert builder.c_build and max(sizes) <= 9 and min(sizes) < max(sizes)  # cleared, refilled


@needs_native
@pytest.mark.parametrize("depth, limit", [(0, 8), (65, 8), (2, 0)])
def test_make_results_refuses_a_bad_ring(depth, limit):
    builder = StepTablesBuilder(MAX_SEQS, MAX_TOKENS, tables=STEP_SPECS_B, device="cpu", backend="torch")
    outputs, (top_cls, top_fields) = R.step_recipe(
        STEP_SPECS_B, builder.layout, False, builder._fla_seqs_pad, builder.pad, builder.capacity.seqs
    )
    compiled = tuple((name, cls, R._descriptors(cls), fields) for name, cls, fields in outputs)
    top = (top_cls, R._descriptors(top_cls), top_fields)
    ring = builder.ring
    with pytest.raises(ValueError, match="depth must be"):
        module.make_results(compiled, top, ring.views, ring.make_view, ring.view_base, depth, limit, ring)


@needs_native
def test_results_refuse_short_plan_tuples():
    builder = StepTablesBuilder(MAX_SEQS, MAX_TOKENS, tables=STEP_SPECS_B, device="cpu", backend="torch")
    with pytest.raises(TypeError, match="as long as the recipe reads"):
        builder._results[False](0, 1, (1,), (0, 0))
