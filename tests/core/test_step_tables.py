"""StepTablesBuilder: every table of a step against the reference, on CPU (the torch fill and the
Triton kernel under the interpreter), exact and padded; bad input; liveness."""

import attrs
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from checks import assert_step_tables
from chunkmeta import ChunkMetaError, StepTablesBuilder
from chunkmeta import tables as T
from strategies import STEP_SPECS, STEP_SPECS_B, lengths_around

MAX_SEQS, MAX_TOKENS = 12, 2048
SPECS, SPECS_B = STEP_SPECS, STEP_SPECS_B


@st.composite
def steps(draw, max_prefills: int = 9):
    """A decode-first batch with each request's computed tokens (0, chunk-aligned, one off, or
    any) and checkpoint offsets (0 or within the request's new tokens)."""
    decodes = draw(st.integers(0, 2))
    prefills = draw(st.lists(lengths_around(16, 200), max_size=max_prefills))
    trailing = draw(st.lists(st.integers(0, 3), max_size=1))
    lengths = [1] * decodes + prefills + trailing
    start = draw(st.sampled_from([0, 0, 7]))
    qsl = [start]
    for n in lengths:
        qsl.append(qsl[-1] + n)
    computed = [
        draw(st.sampled_from([0, 0, 16, 32, 31, 33, 64, 256]) | st.integers(0, 500)) for _ in range(len(lengths))
    ]
    checkpoints = [draw(st.sampled_from([0, 0, n, 1]) | st.integers(0, n)) if n else 0 for n in lengths]
    checkpoints = [min(k, n) for k, n in zip(checkpoints, lengths, strict=True)]
    return qsl, decodes, len(prefills), computed, checkpoints


def build(builder, qsl, first, n, computed, checkpoints, padded=False, dtype=torch.int32):
    q = torch.tensor(qsl, dtype=dtype)
    c = torch.tensor(computed, dtype=dtype)
    k = torch.tensor(checkpoints, dtype=torch.int32)
    return builder.build(
        q,
        q,
        first_seq=first,
        num_seqs=n,
        num_computed_tokens=c,
        num_computed_tokens_cpu=c.clone(),
        checkpoint_offsets=k,
        checkpoint_offsets_cpu=k.clone(),
        padded=padded,
    )


BUILDERS = {}


def builder_for(backend, specs_name, pad="tail"):
    """A CPU builder, kept across examples. ``backend`` "torch": after a layout's first build the C
    build fills the tables (``c_build`` "c"); "python": the torch fill every build (no C build);
    "triton": the interpreted kernel every build (the C build does the host side)."""
    key = (backend, specs_name, pad)
    if key not in BUILDERS:
        specs = SPECS if specs_name == "a" else SPECS_B
        fill = "torch" if backend == "python" else backend
        built = StepTablesBuilder(MAX_SEQS, MAX_TOKENS, tables=specs, device="cpu", backend=fill, pad=pad)
        BUILDERS[key] = python_only(built) if backend == "python" else built
    return BUILDERS[key]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    step=steps(),
    specs_name=st.sampled_from("ab"),
    padded=st.booleans(),
    wide=st.booleans(),
    pad=st.sampled_from(["tail", "negative", "past_end"]),
)
def test_c_fill_equals_reference(step, specs_name, padded, wide, pad):
    """A CPU builder's C build fills the tables itself (chunkmeta.native's cpu_fill_entry, the
    step kernel's logic run serially): exact, in both layouts and every FLA padding, for int32
    and int64 inputs."""
    qsl, first, n, computed, checkpoints = step
    builder = builder_for("torch", specs_name, pad)
    tables = build(builder, qsl, first, n, computed, checkpoints, padded, torch.int64 if wide else torch.int32)
    assert_step_tables(tables, builder, qsl, first, n, computed, checkpoints)
    assert set(builder.c_build.values()) == {"c"}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(step=steps(), specs_name=st.sampled_from("ab"), padded=st.booleans(), wide=st.booleans())
def test_torch_fill_equals_reference(step, specs_name, padded, wide):
    qsl, first, n, computed, checkpoints = step
    builder = builder_for("python", specs_name)
    tables = build(builder, qsl, first, n, computed, checkpoints, padded, torch.int64 if wide else torch.int32)
    assert_step_tables(tables, builder, qsl, first, n, computed, checkpoints)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(step=steps(max_prefills=6), specs_name=st.sampled_from("ab"), padded=st.booleans())
def test_triton_kernel_equals_reference(step, specs_name, padded):
    qsl, first, n, computed, checkpoints = step
    builder = builder_for("triton", specs_name, pad="negative" if padded else "tail")
    tables = build(builder, qsl, first, n, computed, checkpoints, padded)
    assert_step_tables(tables, builder, qsl, first, n, computed, checkpoints)
    assert set(builder.c_build.values()) == {"host"}  # the interpreted kernel ran, every build


EDGES = {
    "empty batch": ([0], 0, 0, [], []),
    "empty prefill": ([0, 1, 2], 2, 0, [5, 9], [0, 0]),
    "zero-length rows": ([0, 0, 0, 0], 0, 3, [0, 16, 17], [0, 0, 0]),
    "aligned prefixes": ([0, 32, 96], 0, 2, [32, 64], [0, 0]),
    "partial first chunks": ([0, 5, 40, 41], 0, 3, [30, 1, 15], [0, 0, 0]),
    "checkpoint at either end": ([0, 40, 80, 81], 0, 3, [3, 0, 16], [40, 1, 1]),
    "one full batch": ([0] + [170 * (i + 1) for i in range(MAX_SEQS)], 0, MAX_SEQS, [7] * MAX_SEQS, [3] * MAX_SEQS),
}


@pytest.mark.parametrize("backend", ["python", "torch", "triton"])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("edge", list(EDGES))
def test_edge_cases(backend, padded, edge):
    """ "torch" builds twice: a layout's first build is the torch fill's, the next the C fill's."""
    qsl, first, n, computed, checkpoints = EDGES[edge]
    for specs_name in "ab":
        builder = builder_for(backend, specs_name)
        for _ in range(2 if backend == "torch" else 1):
            tables = build(builder, qsl, first, n, computed, checkpoints, padded)
            assert_step_tables(tables, builder, qsl, first, n, computed, checkpoints)


# --- bad input: a clear error, nothing written, the builder keeps working ----------------------

GOOD = ([0, 1, 40, 100], 1, 2, [4, 0, 33], [0, 10, 0])


def bad_cases():
    q = torch.tensor(GOOD[0], dtype=torch.int32)
    c = torch.tensor(GOOD[3], dtype=torch.int32)
    k = torch.tensor(GOOD[4], dtype=torch.int32)
    good = dict(num_computed_tokens=c, num_computed_tokens_cpu=c, checkpoint_offsets=k, checkpoint_offsets_cpu=k)
    return {
        "computed missing": ((q, q), dict(good, num_computed_tokens=None), "num_computed_tokens and"),
        "computed host missing": ((q, q), dict(good, num_computed_tokens_cpu=None), "num_computed_tokens and"),
        "computed too short": (
            (q, q),
            dict(good, num_computed_tokens_cpu=c[:2], num_computed_tokens=c[:2]),
            r"num_computed_tokens_cpu has shape \(2,\)",
        ),
        "computed device copy too short": (
            (q, q),
            dict(good, num_computed_tokens=c[:2]),
            "num_computed_tokens has shape",
        ),
        "computed negative": (
            (q, q),
            dict(good, num_computed_tokens_cpu=torch.tensor([4, -1, 3], dtype=torch.int32)),
            r"num_computed_tokens_cpu\[1\]=-1",
        ),
        "computed float": (
            (q, q),
            dict(good, num_computed_tokens_cpu=c.float()),
            "num_computed_tokens_cpu has dtype torch.float32",
        ),
        "computed past int32": (
            (q, q),
            dict(good, num_computed_tokens_cpu=torch.tensor([0, 2**31 - 5, 0], dtype=torch.int64)),
            r"num_computed_tokens_cpu\[1\]=2147483643",
        ),
        # request 1 has 39 new tokens: 2**31 - 40 is its last position within int32 (accepted below)
        "computed one past int32": (
            (q, q),
            dict(good, num_computed_tokens_cpu=torch.tensor([0, 2**31 - 39, 0], dtype=torch.int64)),
            r"num_computed_tokens_cpu\[1\]=2147483609",
        ),
        "computed near int64's max": (  # a sum would wrap past the int32 check
            (q, q),
            dict(good, num_computed_tokens_cpu=torch.tensor([0, 2**63 - 1, 0], dtype=torch.int64)),
            r"num_computed_tokens_cpu\[1\]=9223372036854775807",
        ),
        "computed list": ((q, q), dict(good, num_computed_tokens_cpu=[4, 0, 33]), "num_computed_tokens_cpu is a list"),
        "checkpoint beyond the new tokens": (
            (q, q),
            dict(good, checkpoint_offsets_cpu=torch.tensor([0, 40, 0], dtype=torch.int32)),
            r"checkpoint_offsets_cpu\[1\]=40",
        ),
        "checkpoint negative": (
            (q, q),
            dict(good, checkpoint_offsets_cpu=torch.tensor([0, -3, 0], dtype=torch.int32)),
            r"checkpoint_offsets_cpu\[1\]=-3",
        ),
        "decreasing offsets": (
            (torch.tensor([0, 1, 40, 30], dtype=torch.int32),) * 2,
            good,
            "decreasing at index 3",
        ),
        "over the token capacity": (
            (torch.tensor([0, 1, 40, MAX_TOKENS + 41], dtype=torch.int32),) * 2,
            good,
            "over the builder's capacity",
        ),
        "padded not a bool": ((q, q), dict(good, padded=1), "padded=1"),
    }


@pytest.mark.parametrize("general", [False, True], ids=["c", "general"])
def test_computed_up_to_int32_positions_builds(general):
    """The last computed-token count whose new tokens still end within int32 positions builds
    (the bad cases have the one past it), in the C build and on the general path."""
    builder = StepTablesBuilder(MAX_SEQS, MAX_TOKENS, tables=SPECS, device="cpu", backend="torch")
    if general:
        python_only(builder)
    qsl, first, n, _, checkpoints = GOOD
    computed = [0, 2**31 - 40, 0]  # request 1: 39 new tokens, the last at position 2**31 - 2
    build(builder, qsl, first, n, computed, checkpoints)  # makes the C build
    if not general:
        builder._native = spy = StepSpy(builder._native)
    tables = build(builder, qsl, first, n, computed, checkpoints)
    assert_step_tables(tables, builder, qsl, first, n, computed, checkpoints)
    if not general:
        assert spy.took == [True]  # built in C, not refused there and left to the general path


@pytest.mark.parametrize("case", list(bad_cases()))
def test_bad_input_changes_nothing(case):
    builder = StepTablesBuilder(MAX_SEQS, MAX_TOKENS, tables=SPECS, device="cpu", backend="torch")
    qsl, first, n, computed, checkpoints = GOOD
    before = build(builder, qsl, first, n, computed, checkpoints)
    arena = builder.ring.arena.clone()
    args, kwargs, message = bad_cases()[case]
    with pytest.raises(ChunkMetaError, match=message):
        builder.build(*args, first_seq=1, num_seqs=2, **kwargs)
    assert builder.builds == 1 and before.is_live
    assert torch.equal(builder.ring.arena, arena)
    after = build(builder, qsl, first, n, computed, checkpoints)
    assert after.generation == 2
    assert_step_tables(after, builder, qsl, first, n, computed, checkpoints)


def test_bad_specs():
    with pytest.raises(ChunkMetaError, match="non-empty dict"):
        StepTablesBuilder(4, 64, tables={}, device="cpu")
    with pytest.raises(ChunkMetaError, match="must be a chunkmeta.tables spec"):
        StepTablesBuilder(4, 64, tables={"fla": "fla"}, device="cpu")
    with pytest.raises(ChunkMetaError, match="identifier"):
        StepTablesBuilder(4, 64, tables={"_x": T.Fla()}, device="cpu")
    for taken in ("num_tokens", "num_seqs", "padded", "generation", "names", "is_live", "retire"):
        with pytest.raises(ChunkMetaError, match=f"table name '{taken}' is a StepTables attribute"):
            StepTablesBuilder(4, 64, tables={taken: T.Fla()}, device="cpu")
    with pytest.raises(ChunkMetaError, match="chunk_size=48"):
        T.Mamba2(chunk_size=48)
    for bad in (-2, True, 1.0):
        with pytest.raises(ChunkMetaError, match="seq_idx_pad"):
            T.Mamba2(seq_idx_pad=bad)
    with pytest.raises(ChunkMetaError, match="rows='decode'"):
        T.Conv(rows="decode")
    with pytest.raises(ChunkMetaError, match="block_m=3"):
        T.Conv(block_m=3)
    with pytest.raises(ChunkMetaError, match="offsets_dtype"):
        T.Fla(offsets_dtype=torch.float32)
    with pytest.raises(ChunkMetaError, match="fresh_cu_seqlens=1"):
        T.Fla(fresh_cu_seqlens=1)
    seven = {f"t{i}": T.Conv() for i in range(7)}
    with pytest.raises(ChunkMetaError, match="7 kernel entries"):
        StepTablesBuilder(4, 64, tables=seven, device="cpu")
    with pytest.raises(ChunkMetaError, match="pad='sideways'"):
        StepTablesBuilder(4, 64, tables={"fla": T.Fla()}, device="cpu", pad="sideways")


def test_tables_by_name_and_frozen():
    builder = StepTablesBuilder(4, 256, tables={"conv": T.Conv()}, device="cpu", backend="torch")
    q = torch.tensor([0, 3, 20], dtype=torch.int32)
    tables = builder.build(q, q)
    assert tables.conv is tables["conv"] and tables.names == ("conv",)
    with pytest.raises(ChunkMetaError, match="no table 'mamba2'.*made for \\('conv',\\)"):
        tables["mamba2"]
    with pytest.raises(AttributeError, match="no table 'fla'"):
        tables.fla  # noqa: B018
    with pytest.raises(AttributeError):
        tables.conv.tot = 0
    with pytest.raises(AttributeError):
        tables.padded = True


def test_ring_retires_old_steps():
    builder = StepTablesBuilder(4, 256, tables={"fla": T.Fla(), "conv": T.Conv()}, device="cpu", ring_depth=2)
    q = torch.tensor([0, 3, 20], dtype=torch.int32)
    first = builder.build(q, q)
    second = builder.build(q, q)
    assert first.is_live and second.is_live and first.fla.is_live
    third = builder.build(q, q)
    assert not first.is_live and not first.fla.is_live and third.is_live
    with pytest.raises(ChunkMetaError, match="retired"):
        first.check_live()
    third.retire()
    assert not third.is_live and not second.is_live


def test_a_fill_that_fails_midway_retires_what_its_slot_held(monkeypatch):
    """A live object is never overwritten: a fill that raises after writing part of its slot (the
    torch fill stopped after its first entry) leaves that slot's earlier tables dead, the other
    slots' live, and the builder working."""
    from chunkmeta import step_builder

    # the general path: a CPU builder's C build fills in C, which cannot fail midway
    builder = python_only(
        StepTablesBuilder(4, 256, tables={"fla": T.Fla(), "conv": T.Conv()}, device="cpu", ring_depth=2)
    )
    q = torch.tensor([0, 3, 20], dtype=torch.int32)
    first, second = builder.build(q, q), builder.build(q, q)
    fill = step_builder.fill_entry_torch
    calls = []

    def fails_on_the_second_entry(*args):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("out of memory")
        fill(*args)

    monkeypatch.setattr(step_builder, "fill_entry_torch", fails_on_the_second_entry)
    with pytest.raises(RuntimeError, match="out of memory"):
        builder.build(q, q)  # the slot of `first`
    assert not first.is_live and not first.fla.is_live and second.is_live
    with pytest.raises(ChunkMetaError, match="fill failed"):
        first.check_live()
    monkeypatch.setattr(step_builder, "fill_entry_torch", fill)
    third = builder.build(q, q)
    assert third.is_live and second.is_live
    assert_step_tables(third, builder, q.tolist(), 0, 2)


@pytest.mark.parametrize("path", ["c", "general"])
def test_results_that_fail_after_the_fill_retire_what_its_slot_held(path):
    """The result objects come after the fill has written the slot: if making them raises
    (``MemoryError`` here), the slot's earlier tables are dead all the same, nothing is
    published, and the next build takes the same generation. The C build (``native.step``) and
    the general path agree."""
    builder = StepTablesBuilder(4, 256, tables={"fla": T.Fla(), "conv": T.Conv()}, device="cpu", ring_depth=2)
    if path == "general":
        python_only(builder)
    q = torch.tensor([0, 3, 20], dtype=torch.int32)
    first, second = builder.build(q, q), builder.build(q, q)
    if path == "c":
        builder._native = spy = EnteredSpy(builder._native)
    make = builder._results[False]

    def fails(*args):
        raise MemoryError

    builder._results[False] = fails
    with pytest.raises(MemoryError):
        builder.build(q, q)  # the slot of `first`
    assert not first.is_live and second.is_live and builder.builds == 2
    with pytest.raises(ChunkMetaError, match="fill failed"):
        first.check_live()
    builder._results[False] = make
    third = builder.build(q, q)
    assert third.generation == 3 and third.is_live and second.is_live
    assert_step_tables(third, builder, q.tolist(), 0, 2)
    if path == "c":  # the failing build raised out of native.step; the next one built there
        assert spy.took == ["entered", "entered", True]


def test_counts_match_the_reference_counts():
    """The host counts that size the tables agree with the reference on a larger random batch."""
    rng = np.random.default_rng(0)
    lengths = rng.integers(0, 300, size=MAX_SEQS)
    qsl = [0, *np.cumsum(lengths).tolist()]
    computed = rng.integers(0, 1000, size=MAX_SEQS).tolist()
    checkpoints = [int(rng.integers(0, n + 1)) for n in lengths]
    builder = builder_for("torch", "a")
    tables = build(builder, qsl, 0, MAX_SEQS, computed, checkpoints)
    assert_step_tables(tables, builder, qsl, 0, MAX_SEQS, computed, checkpoints)


def python_only(builder):
    """The same builder's general path: no C build, its results made in Python."""
    builder._native = None
    builder._c_step = None
    builder._steps.clear()
    builder._results = builder._make_results()
    return builder


@pytest.mark.parametrize("executor", ["c", "python"])
def test_fresh_cu_seqlens_or_the_rings_views(executor):
    """FLA memoizes by tensor identity: by default every build hands out new cu_seqlens objects;
    with fresh_cu_seqlens=False a slot's builds of the same size share the ring's cached views.
    The values are the same either way, and so are the other tables."""
    q = [torch.tensor(v, dtype=torch.int32) for v in ([0, 3, 20], [0, 5, 9], [0, 3, 20])]
    objects = {}
    for fresh in (True, False):
        specs = {"fla": T.Fla(fresh_cu_seqlens=fresh), "fla_batch": T.Fla(rows="batch", fresh_cu_seqlens=fresh)}
        builder = StepTablesBuilder(4, 256, tables=specs, device="cpu", backend="torch", ring_depth=2)
        if executor == "python":
            python_only(builder)
        made = [builder.build(x, x) for x in q]  # the third reuses the first one's slot and size
        for step, x in zip(made[1:], q[1:], strict=True):
            for name in specs:
                assert step[name].cu_seqlens.tolist() == step[name].cu_seqlens_cpu.tolist() == x.tolist()
        objects[fresh] = [(m.fla.cu_seqlens, m.fla.cu_seqlens_cpu, m.fla_batch.cu_seqlens) for m in made]
    fresh_ids = {id(t) for step in objects[True] for t in step}
    assert len(fresh_ids) == 9  # all alive in `objects`: distinct ids are distinct objects
    for first, third in zip(objects[False][0], objects[False][2], strict=True):
        assert first is third


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(step=steps(), padded=st.booleans(), damage=st.sampled_from([None, "computed", "checkpoint", "offsets"]))
def test_c_build_agrees_with_python(step, padded, damage):
    """The C build (chunkmeta.native: checks, counts, host copies and, on a CPU builder, the fill)
    gives the Python path's tables (the torch fill), and refuses exactly what it refuses."""
    qsl, first, n, computed, checkpoints = step
    if damage == "computed" and computed:
        computed = [*computed[:-1], -1]
    elif damage == "checkpoint" and n:
        checkpoints = list(checkpoints)
        checkpoints[first] = qsl[first + 1] - qsl[first] + 1
    elif damage == "offsets" and len(qsl) > 2:
        qsl = [*qsl[:-1], qsl[-2] - 1]
    c_builder = StepTablesBuilder(MAX_SEQS, MAX_TOKENS, tables=SPECS, device="cpu", backend="torch")
    py_builder = python_only(StepTablesBuilder(MAX_SEQS, MAX_TOKENS, tables=SPECS, device="cpu", backend="torch"))
    good = ([0, 3, 70], 0, 2, [5, 0], [0, 2])
    build(c_builder, *good[:3], *good[3:], padded)  # makes the C build of this layout
    assert set(c_builder.c_build.values()) == {"c"}  # CPU: the host side and the fill in C
    c_builder._native = spy = StepSpy(c_builder._native)
    errors, results = [], []
    for builder in (c_builder, py_builder):
        try:
            result = build(builder, qsl, first, n, computed, checkpoints, padded)
            errors.append(None)
        except ChunkMetaError as exc:
            errors.append(str(exc))
            continue
        assert_step_tables(result, builder, qsl, first, n, computed, checkpoints)
        results.append(result)
    assert errors[0] == errors[1]
    if len(results) == 2:  # the host fields are the same values of the same types (bools are bools)
        for name in results[0].names:
            for field in attrs.fields(type(results[0][name])):
                got, want = (getattr(r[name], field.name) for r in results)
                if not isinstance(want, torch.Tensor) and field.name not in ("generation", "_lease", "_slot"):
                    assert type(got) is type(want) and got == want, (name, field.name, got, want)
    # a valid step is built by the C build; a bad one is refused there and diagnosed in Python
    assert spy.took == [errors[0] is None]


class _Sub(torch.Tensor):
    pass


# (what is odd, the argument it replaces, the tensor from the plain one, whether the C build takes it)
ODD_TENSORS = [
    ("plain int64 device offsets", "qsl", lambda t: t.to(torch.int64), True),
    ("plain int64 host offsets", "qsl_cpu", lambda t: t.to(torch.int64), True),
    ("plain int64 host computed", "computed_cpu", lambda t: t.to(torch.int64), True),
    # the device dtypes pick the kernel: each combination is its own C build
    ("plain int64 device computed", "computed", lambda t: t.to(torch.int64), True),
    ("plain int64 device checkpoints", "checkpoints", lambda t: t.to(torch.int64), True),
    ("int16 host offsets", "qsl_cpu", lambda t: t.to(torch.int16), False),
    ("float device computed", "computed", lambda t: t.to(torch.float32), False),
    ("strided host offsets", "qsl_cpu", lambda t: torch.stack([t, t], 1)[:, 0], False),
    ("strided device offsets", "qsl", lambda t: torch.stack([t, t], 1)[:, 0], False),
    ("2-D host computed", "computed_cpu", lambda t: t[None], False),
    ("short device computed", "computed", lambda t: t[:-1], False),
    ("long host checkpoints", "checkpoints_cpu", lambda t: torch.cat([t, t[:1]]), False),
    ("a subclass as host offsets", "qsl_cpu", lambda t: t.as_subclass(_Sub), False),
    ("a numpy array as host offsets", "qsl_cpu", lambda t: t.numpy(), False),
    ("meta device offsets", "qsl", lambda t: t.to("meta"), False),
    ("meta device computed", "computed", lambda t: t.to("meta"), False),
    ("sparse host computed", "computed_cpu", lambda t: t.to_sparse(), False),
    ("sparse device offsets", "qsl", lambda t: t.to_sparse(), False),
    ("sparse host offsets", "qsl_cpu", lambda t: t.to_sparse(), False),
]


@pytest.mark.parametrize("what, name, change, taken", ODD_TENSORS, ids=[t[0] for t in ODD_TENSORS])
@pytest.mark.parametrize("specs", [SPECS, SPECS_B], ids=["a", "b"])  # b: Mamba2 without checkpoints
def test_c_build_checks_each_input_tensor(what, name, change, taken, specs):
    """The C build checks every input tensor itself, each build (engines pass new tensor objects
    every step): it takes a plain one of either integer dtype and leaves anything else to the
    general path, which builds the same tables or raises the same error as the Python path.
    (Each mix of offset and per-request dtypes also takes its own typed pass in C.)"""
    qsl, computed, checkpoints = [0, 1, 40, 300], [3, 0, 256], [0, 10, 0]

    def attempt(builder, odd):
        tensors = {
            key: torch.tensor(values, dtype=torch.int32)
            for key, values in [
                ("qsl", qsl),
                ("qsl_cpu", qsl),
                ("computed", computed),
                ("computed_cpu", computed),
                ("checkpoints", checkpoints),
                ("checkpoints_cpu", checkpoints),
            ]
        }
        if odd:
            tensors[name] = change(tensors[name])
        try:
            made = builder.build(
                tensors["qsl"],
                tensors["qsl_cpu"],
                first_seq=1,
                num_computed_tokens=tensors["computed"],
                num_computed_tokens_cpu=tensors["computed_cpu"],
                checkpoint_offsets=tensors["checkpoints"],
                checkpoint_offsets_cpu=tensors["checkpoints_cpu"],
            )
        except ChunkMetaError as exc:  # bad input gets this error, from either path
            return str(exc)
        return {table: _host_values(made[table]) for table in made.names}

    c_builder = StepTablesBuilder(MAX_SEQS, MAX_TOKENS, tables=specs, device="cpu", backend="torch")
    py_builder = python_only(StepTablesBuilder(MAX_SEQS, MAX_TOKENS, tables=specs, device="cpu", backend="torch"))
    attempt(c_builder, odd=False)  # the C build of the int32 inputs
    attempt(c_builder, odd=True)  # and of a new dtype combination, made after its first build
    c_builder._native = spy = StepSpy(c_builder._native)
    assert attempt(c_builder, odd=True) == attempt(py_builder, odd=True), what
    ignored = not c_builder.needs_checkpoints and name.startswith("checkpoints")  # no table reads them
    assert spy.took == [taken or ignored], what


def test_c_build_refuses_a_one_entry_tensor_of_another_stride():
    """A one-request batch's row tensor with stride 2 (a strided view of one entry): the general
    path's checks refuse it, so the C build leaves it to them."""
    builder = StepTablesBuilder(4, 256, tables={"m": T.Mamba2(chunk_size=64), "conv": T.Conv()}, device="cpu")
    q, c = torch.tensor([0, 30], dtype=torch.int32), torch.tensor([5], dtype=torch.int32)
    builder.build(q, q, num_computed_tokens=c, num_computed_tokens_cpu=c)  # makes the C build
    builder._native = spy = StepSpy(builder._native)
    odd = torch.tensor([5, 99], dtype=torch.int32)[::2]
    assert odd.shape == (1,) and odd.stride() == (2,)
    with pytest.raises(ChunkMetaError, match="contiguous"):
        builder.build(q, q, num_computed_tokens=odd, num_computed_tokens_cpu=c)
    assert spy.took == [False]


def test_a_builder_on_another_device_compares_devices():
    """A builder on a device other than the CPU or CUDA (meta here) takes the general path, which
    refuses CPU tensors as its device copies."""
    builder = StepTablesBuilder(4, 256, tables={"fla": T.Fla()}, device="meta", backend="torch")
    q = torch.tensor([0, 3, 20], dtype=torch.int32)
    builder.build(q.to("meta"), q)
    with pytest.raises(ChunkMetaError, match="builder's buffers are on meta"):
        builder.build(q, q)


def _host_values(table) -> dict:
    """A table's fields, tensors as lists (the ring's bookkeeping left out)."""
    values = {}
    for field in attrs.fields(type(table)):
        if field.name not in ("generation", "_lease", "_slot"):
            value = getattr(table, field.name)
            values[field.name] = value.tolist() if isinstance(value, torch.Tensor) else value
    return values


class StepSpy:
    """The native module, recording whether each step() / step_host() call built the step."""

    def __init__(self, module):
        self.module = module
        self.took = []

    def __getattr__(self, name):
        return getattr(self.module, name)

    def step(self, *args):
        out = self.module.step(*args)
        self.took.append(type(out) is not int)
        return out

    def step_host(self, *args):
        out = self.module.step_host(*args)
        self.took.append(type(out) is not int)
        return out


class EnteredSpy(StepSpy):
    """A StepSpy that also records each step() call as it starts."""

    def step(self, *args):
        self.took.append("entered")
        return super().step(*args)


HOST_ODD_TENSORS = [odd for odd in ODD_TENSORS if odd[1].endswith("_cpu")]


@pytest.mark.parametrize("what, name, change, taken", HOST_ODD_TENSORS, ids=[t[0] for t in HOST_ODD_TENSORS])
def test_graph_prepare_checks_each_host_tensor(what, name, change, taken):
    """Graph mode's host side checks the host tensors in the same C call as its plan
    (``step_host``): it takes a plain one of either integer dtype and leaves anything else to
    the general path, which prepares the same step or raises the same error."""
    from chunkmeta import StepGraphBuild

    values = {"qsl_cpu": [0, 1, 40, 300], "computed_cpu": [3, 0, 256], "checkpoints_cpu": [0, 10, 0]}

    def graph_of(c_plan: bool):
        builder = StepTablesBuilder(MAX_SEQS, MAX_TOKENS, tables=SPECS, device="cpu", backend="triton")
        qsl_static, rows_static = torch.zeros(MAX_SEQS + 1, dtype=torch.int32), torch.zeros(MAX_SEQS, dtype=torch.int32)
        graph = StepGraphBuild(
            builder, qsl_static, num_computed_tokens=rows_static, checkpoint_offsets=rows_static.clone()
        )
        assert graph._c_plan is not None
        if not c_plan:
            graph._c_plan = None
        return graph

    def prepare(graph):
        host = {key: torch.tensor(v, dtype=torch.int32) for key, v in values.items()}
        host[name] = change(host[name])
        try:
            made = graph.prepare(
                host["qsl_cpu"],
                first_seq=1,
                num_computed_tokens_cpu=host["computed_cpu"],
                checkpoint_offsets_cpu=host["checkpoints_cpu"],
            )
        except ChunkMetaError as exc:  # bad input gets this error, from either path
            return str(exc)
        # the host side's outputs: the tables' host fields and cu_seqlens_cpu, the staged params
        tables = {table: _host_values(made[table]) for table in made.names}
        return made.num_seqs, made.num_tokens, tables, graph._staged.params.tolist()

    c_graph = graph_of(c_plan=True)
    c_graph.builder._native = spy = StepSpy(c_graph.builder._native)
    assert prepare(c_graph) == prepare(graph_of(c_plan=False)), what
    assert spy.took == [taken], what


def test_same_tensor_changed_in_place_is_checked_again():
    """A tensor given new storage (and length) in place between builds is read as it is now:
    every build checks its inputs, none is trusted from an earlier one."""
    builder = StepTablesBuilder(4, 256, tables={"fla": T.Fla(), "conv": T.Conv()}, device="cpu", backend="torch")
    q = torch.tensor([0, 3, 20], dtype=torch.int32)
    for _ in range(3):
        builder.build(q, q)
    q.set_(torch.tensor([0, 3, 20, 100], dtype=torch.int32))  # longer
    tables = builder.build(q, q)
    assert tables.fla.cu_seqlens.tolist() == [0, 3, 20, 100] and tables.conv.tot == 1 + 3 + 10
    q.set_(torch.tensor([0, 5], dtype=torch.int32))
    tables = builder.build(q, q)
    assert tables.fla.cu_seqlens.tolist() == [0, 5] and tables.conv.tot == 1
    q.set_(torch.tensor([0, 5, 2], dtype=torch.int32))
    with pytest.raises(ChunkMetaError, match="decreasing"):
        builder.build(q, q)


# --- graph mode: static buffers, params on the device, one launch for any step -----------------


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch_steps=st.lists(steps(max_prefills=6), min_size=1, max_size=3), specs_name=st.sampled_from("ab"))
def test_graph_mode_launch_serves_every_step(batch_steps, specs_name):
    """One StepGraphBuild, its launch() run as a replay would (same arguments every step), the
    static buffers rewritten in place between steps: every step's tables are exact."""
    from chunkmeta import StepGraphBuild

    builder = builder_for("triton", specs_name)
    qsl_static = torch.zeros(MAX_SEQS + 1, dtype=torch.int32)
    computed_static = torch.zeros(MAX_SEQS, dtype=torch.int32)
    checkpoints_static = torch.zeros(MAX_SEQS, dtype=torch.int32)
    graph = StepGraphBuild(
        builder, qsl_static, num_computed_tokens=computed_static, checkpoint_offsets=checkpoints_static
    )
    previous = None
    for qsl, first, n, computed, checkpoints in batch_steps:
        qsl_static[: len(qsl)] = torch.tensor(qsl, dtype=torch.int32)
        computed_static[: len(computed)] = torch.tensor(computed, dtype=torch.int32)
        checkpoints_static[: len(checkpoints)] = torch.tensor(checkpoints, dtype=torch.int32)
        tables = graph.prepare(
            torch.tensor(qsl, dtype=torch.int32),
            first_seq=first,
            num_seqs=n,
            num_computed_tokens_cpu=torch.tensor(computed, dtype=torch.int32),
            checkpoint_offsets_cpu=torch.tensor(checkpoints, dtype=torch.int32),
        )
        assert graph.launch() is tables and tables.is_live
        if previous is not None:
            assert not previous.is_live
        assert_step_tables(tables, builder, qsl, first, n, computed, checkpoints)
        previous = tables


def test_graph_mode_bad_input_stages_nothing():
    from chunkmeta import StepGraphBuild

    builder = builder_for("triton", "a")
    qsl_static = torch.zeros(MAX_SEQS + 1, dtype=torch.int32)
    zeros = torch.zeros(MAX_SEQS, dtype=torch.int32)
    graph = StepGraphBuild(builder, qsl_static, num_computed_tokens=zeros, checkpoint_offsets=zeros.clone())
    q = torch.tensor([0, 4, 9], dtype=torch.int32)
    c = torch.tensor([0, 3], dtype=torch.int32)
    good = graph.prepare(q, num_computed_tokens_cpu=c, checkpoint_offsets_cpu=c * 0)
    params = graph._staged.params.clone()
    for kwargs, message in (
        (dict(num_computed_tokens_cpu=c, checkpoint_offsets_cpu=torch.tensor([0, 6], dtype=torch.int32)), "checkpoint"),
        (dict(num_computed_tokens_cpu=None, checkpoint_offsets_cpu=c), "num_computed_tokens and"),
        (dict(num_computed_tokens_cpu=c, checkpoint_offsets_cpu=c, num_seqs=5), "num_seqs=5"),
    ):
        with pytest.raises(ChunkMetaError, match=message):
            graph.prepare(q, **kwargs)
        assert good.is_live and torch.equal(graph._staged.params, params)
    too_long = torch.arange(MAX_SEQS + 2, dtype=torch.int32)
    with pytest.raises(ChunkMetaError, match="static query_start_loc buffer"):
        graph.prepare(too_long, num_computed_tokens_cpu=too_long[:-1], checkpoint_offsets_cpu=too_long[:-1] * 0)
    # a static buffer shorter than the builder's capacity bounds the batch too (its kernel reads it)
    short = StepGraphBuild(builder, qsl_static[:4], num_computed_tokens=zeros, checkpoint_offsets=zeros.clone())
    five = torch.arange(5, dtype=torch.int32)
    with pytest.raises(ChunkMetaError, match="static query_start_loc buffer holds 4"):
        short.prepare(five, num_computed_tokens_cpu=five[:-1] * 0, checkpoint_offsets_cpu=five[:-1] * 0)
    short.builder._native = spy = StepSpy(short.builder._native)
    fits = short.prepare(five[:4], num_computed_tokens_cpu=five[:3] * 0, checkpoint_offsets_cpu=five[:3] * 0)
    assert fits.num_seqs == 3 and spy.took == [True]  # a batch the buffer holds exactly: the C call's
    short.builder._native = spy.module
    with pytest.raises(ChunkMetaError, match="replay\\(\\) before capture"):
        graph.replay(q, num_computed_tokens_cpu=c, checkpoint_offsets_cpu=c * 0)
    with pytest.raises(ChunkMetaError, match="num_computed_tokens must be"):
        StepGraphBuild(builder, qsl_static)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_positions_near_int32(backend):
    """A request whose cached prefix ends just below 2^31 tokens: its chunks' next boundaries lie
    past int32 (the fills compute them in int64)."""
    builder = builder_for(backend, "b")
    qsl, computed = [0, 5, 9], [2**31 - 10, 2**31 - 100]
    tables = build(builder, qsl, 0, 2, computed, [0, 0])
    assert_step_tables(tables, builder, qsl, 0, 2, computed, [0, 0])


@pytest.mark.parametrize("backend", ["torch", "python", "triton"])
def test_tables_are_inference_tensors(backend):
    """chunkmeta.ring.TABLE_MEMORY: every table of a step is an inference tensor, exact and padded."""
    qsl, computed, checkpoints = [0, 1, 40, 300], [0, 16, 33], [0, 20, 0]
    for padded in (False, True):
        tables = build(builder_for(backend, "a"), qsl, 1, 2, computed, checkpoints, padded=padded)
        tensors = [
            value
            for name in tables.names
            for value in attrs.asdict(tables[name], recurse=False).values()
            if isinstance(value, torch.Tensor)
        ]
        assert len(tensors) >= 2 * len(tables.names) and all(t.is_inference() for t in tensors)


def test_mamba2_padding_chunks_name_the_row_asked_for():
    """A capacity-shaped Mamba2 step (a mixed-step bucket) pads ``seq_idx`` with a row it has, so
    that vLLM's chunk scan, which reads ``initial_states[seq_idx]`` of every chunk, stays in
    bounds; the padding chunks stay empty (``cu_chunk_seqlens`` at the total)."""
    q, c = torch.tensor([0, 30, 31], dtype=torch.int32), torch.tensor([5, 0], dtype=torch.int32)
    for pad in (-1, 3):
        builder = StepTablesBuilder(4, 128, tables={"m": T.Mamba2(chunk_size=16, seq_idx_pad=pad)}, device="cpu")
        m = builder.build(q, q, num_computed_tokens=c, num_computed_tokens_cpu=c, padded=True)["m"]
        real = m.num_chunks
        # row 0: 30 tokens after 5 cached, cut on absolute positions 16 and 32; row 1: one token
        assert m.seq_idx[:real].tolist() == [0, 0, 0, 1] and set(m.seq_idx[real:].tolist()) == {pad}
        assert set(m.cu_chunk_seqlens[real + 1 :].tolist()) == {31}
