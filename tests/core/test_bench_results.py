"""bench/results.py, bench/render.py, bench/plot.py: the records' round trip, RESULTS.md and the
picture drawn from them, and `render --check` failing on either when it is stale."""

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "bench" / "diagnostics"))  # ab_compare

import plot  # noqa: E402
import render  # noqa: E402
import results  # noqa: E402


def check(tmp_path, *command):
    paths = ["--data", str(tmp_path / "runs.jsonl"), "--results-md", str(tmp_path / "R.md")]
    pictures = ["--picture", str(tmp_path / "p.png"), "--engine-picture", str(tmp_path / "e.png")]
    return results.main([*paths, *pictures, *command])


@pytest.fixture
def data(tmp_path):
    shutil.copy(results.DATA, tmp_path / "runs.jsonl")
    return tmp_path


def test_committed_results_md_and_picture_are_what_the_data_draw():
    assert results.main(["render", "--check"]) == 0


def test_render_check_fails_on_a_stale_file_and_render_mends_it(data):
    assert check(data, "render", "--check") == 1  # nothing written yet
    assert check(data, "render") == 0 and check(data, "render", "--check") == 0
    (data / "R.md").write_text((data / "R.md").read_text() + "edited\n")
    assert check(data, "render", "--check") == 1
    assert check(data, "render") == 0
    png = bytearray((data / "p.png").read_bytes())
    image = plot.picture(*plot.series(results.load()))
    image[100, 200] = 1 if image[100, 200] != 1 else 0  # one pixel of another colour
    (data / "p.png").write_bytes(plot.png(image))
    assert check(data, "render", "--check") == 1
    (data / "p.png").write_bytes(png)
    assert check(data, "render", "--check") == 0


def test_a_new_record_changes_results_md_and_the_picture(data):
    records = results.load(data / "runs.jsonl")
    shown = plot.draw(records)[1]  # the record the picture shows now (an old tree's A/B run has no vLLM series)
    row = json.loads(json.dumps(shown["figures"]["rows"][0]))
    row["methods"]["chunkmeta_kda_gdn"]["host_idle_us"] = 3.25
    record = results.make_record(
        "step_tables",
        {"rows": [row, row]},
        command="python bench/step_tables.py",
        date="2030-01-01 00:00:00 UTC",
        commit="abc",
        device={"gpu": "X"},
    )
    with (data / "runs.jsonl").open("a") as f:
        f.write(json.dumps(record) + "\n")
    assert check(data, "render") == 0
    text = (data / "R.md").read_text()
    assert "Latest: `step_tables@2030-01-01T00:00:00Z`" in text
    assert "| `step_tables@2030-01-01T00:00:00Z` | abc | X | KDA/GDN 3.2 µs;" in text
    drawn, shown = plot.draw(results.load(data / "runs.jsonl"))
    assert shown["id"] == record["id"] and not plot.same_png(drawn, (ROOT / "docs" / "host_time.png").read_bytes())


def test_results_md_names_every_record_and_shows_each_familys_latest():
    records = results.load()
    text = results.RESULTS_MD.read_text()
    for r in records:
        assert f"| `{r['id']}` |" in text, r["id"]
    for kind in {r["kind"] for r in records}:
        kept = [r for r in records if r["kind"] == kind and not {"experiment", "flawed"} & set(r)]
        rows = render.FAMILIES[kind].rows if kind in render.FAMILIES else None
        kept = [r for r in kept if rows is None or r["figures"].get(rows)] or kept
        if kept:
            assert f"Latest: `{max(kept, key=lambda r: r['date'])['id']}`" in text


def test_history_lines_are_ranges_over_the_rows():
    family = render.Family("t", "about", rows="rows", summary="host {us:.1f} µs; {ratio:.1f}x at {n}; {ok}")
    rows = [{"us": 8.31, "ratio": 52.4, "n": 1, "ok": True}, {"us": 10.29, "ratio": 572.8, "n": 8, "ok": True}]
    assert render.summary(family, {"figures": {"rows": rows}}) == "host 8.3–10.3 µs; 52.4x at 1, 572.8x at 8; yes"
    assert render.summary(family, {"figures": {"rows": [{"x": 1}]}}) == "—"  # no format applies


def test_vllm_full_graph_shows_the_async_figures_and_records_without_them_as_before():
    family = render.FAMILIES["vllm_full_graph"]
    serial = {"ms_per_step": 2.0, "syncs_per_step": 0}
    old = {"requests": 8, "tokens": 256, "speedup_full": 3.0, "states_equal": True, "chunkmeta_full": serial}
    new = {**old, "speedup_full_async": 2.5, "chunkmeta_full": {**serial, "async_ms_per_step": 1.5}}
    assert "| chunkmeta_full | 2.000 ms/step, 0 syncs |" in latest_table_text(family, old)
    assert "| chunkmeta_full | 2.000 ms/step (async 1.500), 0 syncs |" in latest_table_text(family, new)
    assert render.summary(family, {"figures": {"steps": [old]}}) == (
        "full 3.00x vllm_piecewise at 8 x 256; states equal yes"
    )
    assert render.summary(family, {"figures": {"steps": [new]}}) == (
        "full 3.00x vllm_piecewise at 8 x 256; async 2.50x; states equal yes"
    )


def test_a_vllm_full_graph_record_of_the_exact_part_alone_is_in_the_history_not_the_latest_table():
    family = render.FAMILIES["vllm_full_graph"]
    exact = {"layer": "gdn", "requests": 32, "tokens": 512, "batches": 200, "bit_identical": True}
    steps = {"requests": 8, "tokens": 256, "speedup_full": 3.0, "states_equal": True}
    runs = [
        {"id": "a", "figures": {"steps": [steps], "exact": []}},
        {"id": "b", "figures": {"steps": [], "exact": [exact]}},
    ]
    assert render.latest_record(family, runs)["id"] == "a"
    assert render.summary(family, runs[1]) == "exact gdn 32 x 512, 200 batches: bit-identical yes"
    assert render.latest_record(family, runs[1:])["id"] == "b"  # no record with steps: the newest


def latest_table_text(family, row):
    return "\n".join(render.latest_table(family, {"figures": {"steps": [row]}}))


def holds_all_three(record):
    try:
        return plot.series([record])[0] is record
    except ValueError:
        return False


def test_the_picture_is_the_latest_step_tables_record_with_all_three_series():
    records = results.load()
    first, shown = plot.draw(records)
    assert first == plot.draw(records)[0]  # the same data, the same bytes
    assert first[:8] == b"\x89PNG\r\n\x1a\n" and first[16:24] == (960).to_bytes(4, "big") + (736).to_bytes(4, "big")
    with_all = [r for r in records if r["kind"] == "step_tables" and holds_all_three(r)]
    assert shown is max(with_all, key=lambda r: r["date"])
    without_vllm = [r for r in records if r["kind"] == "step_tables" and not r["figures"]["engine_functions"]]
    with pytest.raises(ValueError, match="no step_tables record"):
        plot.series(without_vllm)


def _engine_record(date, ttft_ms):
    """A vllm_engine record of two models, two workloads, three concurrencies; chunkmeta_graphs
    has no figures at 32 for nemotron_h (a method may be absent from a row)."""
    methods = (("vllm", 1.0), ("chunkmeta", 0.9), ("chunkmeta_graphs", 0.8))
    rows = [
        {
            "model": model,
            "workload": workload,
            "concurrency": c,
            "methods": {
                name: {"mean_ttft_ms": ttft_ms * c * f, "mean_tpot_ms": (6 + c / 8) * f, "total_tok_s": 90.0 * c}
                for name, f in methods
                if (model, name, c) != ("nemotron_h", "chunkmeta_graphs", 32)
            },
        }
        for model in ("qwen3_5", "nemotron_h")
        for workload in ("seed", "short")
        for c in (1, 8, 32)
    ]
    command = "python bench/vllm_engine.py"
    return results.make_record("vllm_engine", {"rows": rows}, command=command, date=date, commit="a", device={})


def test_the_engine_picture_is_the_latest_vllm_engine_record_and_render_check_sees_it_stale(tmp_path):
    records = [r for r in results.load() if r["kind"] != "vllm_engine"]
    results.write_records(tmp_path / "runs.jsonl", records)
    assert plot.draw_engine(records) is None  # no vllm_engine record: no picture, none checked
    assert check(tmp_path, "render") == 0 and check(tmp_path, "render", "--check") == 0
    assert not (tmp_path / "e.png").exists()

    old, new = _engine_record("2030-01-01 00:00:00 UTC", 40.0), _engine_record("2030-01-02 00:00:00 UTC", 50.0)
    results.write_records(tmp_path / "runs.jsonl", [*records, old, new])
    assert check(tmp_path, "render", "--check") == 1  # the picture is now due
    assert check(tmp_path, "render") == 0 and check(tmp_path, "render", "--check") == 0
    drawn = (tmp_path / "e.png").read_bytes()
    assert drawn[:8] == b"\x89PNG\r\n\x1a\n"
    assert drawn[16:24] == (960).to_bytes(4, "big") + (788).to_bytes(4, "big")  # 2 models' rows, 3 methods
    assert plot.draw_engine(results.load(tmp_path / "runs.jsonl")) == (drawn, new)
    assert plot.engine_workload(new) == "short"
    (tmp_path / "e.png").write_bytes(plot.png(plot.engine_picture(old)))  # the older record's picture
    assert check(tmp_path, "render", "--check") == 1
    assert check(tmp_path, "render") == 0 and plot.same_png((tmp_path / "e.png").read_bytes(), drawn)

    seed_only = {**new, "figures": {"rows": [r for r in new["figures"]["rows"] if r["workload"] == "seed"]}}
    assert plot.engine_workload(seed_only) == "seed"  # no "short": the rows' first workload
    assert plot.engine_picture(seed_only).shape == (788, 960)


def test_the_font_refuses_a_character_it_lacks():
    with pytest.raises(ValueError, match="no '€'"):
        plot.text(plot.np.zeros((40, 40), dtype=plot.np.uint8), 0, 0, "€")


def test_records_round_trip_from_a_stage_to_the_data_file(tmp_path, monkeypatch):
    monkeypatch.setenv("CHUNKMETA_COMMIT", "unknown")
    out = tmp_path / "out"
    record = results.save("stress", {"steps": 1}, script="bench/stress.py", argv=["--out", str(out)], out=out)
    assert record["command"] == "python bench/stress.py --out $OUT"
    log = tmp_path / "log"
    log.write_text("SKIPPED [1] tests/x.py:3: no GPU\n==== 3 passed, 1 skipped in 1.50s ====\n")
    assert results.main(["record", "gpu_tests", str(log), "--out", str(out), "--command", "bash x"]) == 0
    assert results.gather(str(out), str(tmp_path / "all.jsonl")) == 0
    data = tmp_path / "runs.jsonl"
    data.write_text("")
    assert results.main(["--data", str(data), "add", str(tmp_path / "all.jsonl"), "--commit", "abc"]) == 0
    added = results.load(data)
    assert [r["kind"] for r in added] == ["gpu_tests", "stress"] and {r["commit"] for r in added} == {"abc"}
    assert added[0]["figures"]["passed"] == 3 and added[0]["figures"]["skip_reasons"] == ["tests/x.py:3: no GPU"]
    with pytest.raises(SystemExit, match="already in"):
        results.add([str(tmp_path / "all.jsonl")], None, data)


@pytest.mark.parametrize(
    "change, error",
    [
        ({"kind": "nope"}, "is not one of"),
        ({"command": "python /work/x.py"}, "machine path"),
        ({"extra": 1}, "unknown"),
    ],
)
def test_validate_refuses_a_bad_record(change, error):
    record = results.make_record("stress", {}, command="python bench/stress.py", commit="abc", device={})
    with pytest.raises(ValueError, match=error):
        results.validate({**record, **change})


def _tables_record(kind, device_us, host_us, floor_us):
    """A gpu_compare or step_tables record of one workload with chunkmeta, floor and an anchor."""
    if kind == "gpu_compare":
        methods = {
            "chunkmeta": {"host_idle_p50": host_us, "device_us": device_us},
            "floor": {"host_idle_p50": 20.0, "device_us": floor_us},
            "fla_sync": {"host_idle_p50": 300.0, "device_us": 200.0},
            "_workload": "1x4k",
        }
        figures = {"results": {"1x4k": methods}}
    else:
        methods = {"chunkmeta_mamba2": {"host_idle_us": host_us, "device_us": device_us}}
        figures = {"rows": [{"decodes": 0, "prefills": 2, "tokens": 64, "methods": methods}]}
    return results.make_record(kind, figures, command="x", commit="c", device={"gpu": "g"})


def test_ab_compare_takes_medians_per_tree_and_guards_chunkmeta_only():
    import ab_compare

    new = [_tables_record("gpu_compare", d, 6.0, 2.0) for d in (2.0, 2.1, 9.0)]  # one outlier run
    old = [_tables_record("gpu_compare", d, 8.0, 1.0) for d in (2.0, 2.0, 2.0)]
    new += [_tables_record("step_tables", 3.3, 5.0, 0)]
    old += [_tables_record("step_tables", 3.0, 5.0, 0)]
    figures = ab_compare.compare({"new": new, "old": old}, 1.05)
    rows = {(r["kind"], r["method"], r["metric"]): r for r in figures["rows"]}
    assert rows[("gpu_compare", "chunkmeta", "device_us")]["ratio"] == 1.05  # the median, 2.1 / 2.0
    assert rows[("gpu_compare", "chunkmeta", "device_us")]["runs"] == [3, 3]
    assert rows[("gpu_compare", "chunkmeta", "host_p50_us")]["ratio"] == 0.75
    assert rows[("gpu_compare", "floor", "device_us")]["ratio"] == 2.0  # shown, not guarded
    assert not any(m == "fla_sync" for _, m, _ in rows)
    assert figures["worst"]["method"] == "chunkmeta_mamba2" and figures["worst"]["ratio"] == 1.1
    assert not figures["guard_met"]
    assert [r["method"] for r in figures["over_limit"]] == ["chunkmeta_mamba2"]
    figures = ab_compare.compare({"new": new[:3], "old": old[:3]}, 1.05)
    assert figures["guard_met"]  # at the limit is within it
    record = results.make_record("gpu_ab", {"old_commit": "o", **figures}, command="x", commit="c", device={})
    assert "met yes" in render.summary(render.FAMILIES["gpu_ab"], record)
    wrong = json.loads(json.dumps(new[0]))
    wrong["figures"]["results"]["1x4k"]["chunkmeta"]["matched"] = False  # fast, but not the reference's tables
    figures = ab_compare.compare({"new": [wrong, *new[1:3]], "old": old[:3]}, 1.05)
    assert not figures["all_exact"] and not figures["guard_met"]


def test_ab_compare_pools_calls_by_tree(tmp_path):
    import ab_compare

    def call(name, new_device, old_device):
        new = _tables_record("gpu_compare", new_device, 6.0, 2.0)
        old = {**_tables_record("gpu_compare", old_device, 6.0, 2.0), "experiment": "the old tree"}
        old["id"] += "-old"  # two runs of one second: a data file's ids are unique
        figures = {"pairs": 1, "rounds": 3, "stages": ["bench"], "old_commit": "o"}
        figures.update(ab_compare.compare({"new": [new], "old": [old]}, 1.05))
        ab = results.make_record("gpu_ab", figures, command="x", commit="c", device={})
        path = tmp_path / name / "runs.jsonl"
        path.parent.mkdir()
        path.write_text("".join(json.dumps(r) + "\n" for r in (new, old, ab)))
        return path

    first, second = call("a", 2.2, 2.0), call("b", 2.0, 2.0)  # alone: 1.1, then 1.0
    figures = ab_compare.pool([first, second], tmp_path / "out", 1.05)
    rows = {(r["method"], r["metric"]): r for r in figures["rows"]}
    assert rows[("chunkmeta", "device_us")]["runs"] == [2, 2]  # every run of both calls, by tree
    assert rows[("chunkmeta", "device_us")]["ratio"] == 1.05  # median of (2.2, 2.0) over 2.0
    assert figures["pairs"] == 2 and figures["pooled_calls"] == 2
    (written,) = results.load(tmp_path / "out" / "runs.jsonl")
    assert written["kind"] == "gpu_ab" and written["figures"]["rows"] == figures["rows"]


def test_ab_compare_shows_each_run_over_its_floor_and_shares_the_carried_bundles(tmp_path):
    import ab_compare

    # the floor's mode moves chunkmeta's device time with it: 2.4 over 1.8 is 2.6 over 1.95
    new = [_tables_record("gpu_compare", 2.6, 6.0, 1.95), _tables_record("gpu_compare", 2.6, 6.0, 1.95)]
    old = [_tables_record("gpu_compare", 2.4, 6.0, 1.8), _tables_record("gpu_compare", 2.4, 6.0, 1.8)]
    rows = {(r["method"], r["metric"]): r for r in ab_compare.compare({"new": new, "old": old}, 1.05)["rows"]}
    assert rows[("chunkmeta", "device_us")]["ratio"] > 1.05
    assert rows[("chunkmeta", "device_us")]["ratio_per_floor"] == 1.0
    assert "ratio_per_floor" not in rows[("floor", "device_us")]
    new_tree, old_tree = tmp_path / "new", tmp_path / "old"
    (new_tree / ".vllm_bundle").mkdir(parents=True)
    (new_tree / ".whl").mkdir()
    (old_tree / "elsewhere").mkdir(parents=True)
    (old_tree / ".whl").symlink_to("gone")  # the old tree's own, dangling: kept, not replaced
    ab_compare.share_carried(new_tree, old_tree)
    assert (old_tree / ".vllm_bundle").resolve() == (new_tree / ".vllm_bundle").resolve()
    assert not Path(os.readlink(old_tree / ".vllm_bundle")).is_absolute()  # the trees travel side by side
    assert os.readlink(old_tree / ".whl") == "gone"


def test_ab_compare_pools_only_one_ab(tmp_path):
    import ab_compare

    def call(name, device=None, **changed):
        new = _tables_record("gpu_compare", 2.0, 6.0, 2.0)
        figures = {"pairs": 1, "rounds": 3, "stages": ["bench"], "old_commit": "o", "rows": [], **changed}
        ab = results.make_record("gpu_ab", figures, command="x", commit="c", device=device or {"gpu": "H100"})
        path = tmp_path / name / "runs.jsonl"
        path.parent.mkdir()
        path.write_text("".join(json.dumps(r) + "\n" for r in (new, ab)))
        return path

    first = call("a")
    for name, changed in (("b", {"old_commit": "p"}), ("c", {"rounds": 6}), ("d", {"device": {"gpu": "H200"}})):
        with pytest.raises(SystemExit, match="not one A/B"):
            ab_compare.pool([first, call(name, **changed)], tmp_path / "out", 1.05)
    # a figure one call's device has and the other's not is no other machine
    assert ab_compare.pool([first, call("e", device={"gpu": "H100", "nvrtc": "13.0"})], tmp_path / "out", 1.05)


def test_full_graph_pipeline_keeps_one_step_in_flight():
    import vllm_full_graph

    log = []

    class Event:
        made = 0

        def __init__(self):
            Event.made += 1
            self.name = f"e{Event.made}"

        def record(self):
            log.append(f"record {self.name}")

        def synchronize(self):
            log.append(f"wait {self.name}")

    def step(case, inputs_prepared):
        log.append(f"inputs {case}")
        inputs_prepared()
        log.append(f"launch {case}")

    vllm_full_graph.pipelined(step, ["A", "B"], Event)
    assert log == [
        "wait e1",  # the inputs event (nothing recorded yet)
        "inputs A", "record e1", "launch A", "record e2",  # e2: A done
        "wait e1",  # A's inputs prepared before B rewrites the pinned buffers
        "inputs B", "record e1", "launch B", "record e3",
        "wait e2",  # then A's completion: one step in flight
    ]  # fmt: skip
