"""docs/host_time.png and docs/engine_serving.png, log-log, drawn from bench/results/runs.jsonl.

    python bench/results.py render      draws them beside bench/RESULTS.md (render --check verifies them)

docs/engine_serving.png, once a vllm_engine record has rows (bench/vllm_engine.py; before that
there is none to draw or check): the record RESULTS.md shows, one workload ("short" where it has
one, else its rows' first), per model a row of two panels, mean TTFT and mean TPOT (ms) against
concurrency, a series per method (vllm, chunkmeta, chunkmeta_graphs); the picture names the record.

docs/host_time.png: host µs per step against requests in the step.

Three series from the latest ``step_tables`` record that holds all three (bench/step_tables.py):
chunkmeta's one build of a Kimi-Linear / Qwen3-Next step's tables (``chunkmeta_kda_gdn``: FLA
prefill, FLA batch, causal-conv1d), vLLM 0.33.0's own functions for the same tables (the sum of
their medians, ``vllm_kda_gdn_step_us``) and FLA's helpers for the FLA prefill table alone
(``fla_host``), each the p50 of calls back to back; the picture names the record.

numpy and the standard library only (no plotting library on the GPU machine or in the test
venv): lines and markers are rasterized into a palette image, text comes from the 5x8 bitmap
font below, and the PNG is written with zlib. The same data draw the same pixels.
"""

from __future__ import annotations

import math
import struct
import zlib
from typing import NamedTuple

import numpy as np
from render import FAMILIES, latest_record

# 5x8 glyphs: the character, then its 8 rows top to bottom, each row a base-32 digit whose 5 bits
# are the pixels left to right (row 7 only for descenders). Space is blank.
FONT_TABLE = """
0ehjlphe0 14c4444e0 2eh1248v0 3v2421he0 426aiv220 5vgu11he0 668guhhe0 7v1248880 8ehhehhe0
9ehhf12c0 Aehhvhhh0 Buhhuhhu0 Cehggghe0 Dsihhhis0 Evgguggv0 Fvgguggg0 Gehgnhhf0 Hhhhvhhh0 Ie44444e0
J72222ic0 Khikokih0 Lggggggv0 Mhrllhhh0 Nhhpljhh0 Oehhhhhe0 Puhhuggg0 Qehhhlid0 Ruhhukih0 Sfgge11u0
Tv4444440 Uhhhhhhe0 Vhhhhha40 Whhhllla0 Xhha4ahh0 Yhha44440 Zv1248gv0 a00e1fhf0 bggmphhu0 c00egghe0
d11djhhf0 e00ehvge0 f698s8880 g00fhhf1e hggmphhh0 i40c444e0 j206222ic kggikoki0 lc44444e0 m00qllll0
n00mphhh0 o00ehhhe0 p00uhhugg q00fhhf11 r00mpggg0 s00ege1u0 t88s88960 u00hhhjd0 v00hhha40 w00hhlla0
x00ha4ah0 y00hhhf1e z00v248v0 µ00hhhjtg .00000cc0 ,0000cc48 :0cc0cc00 ;0cc0cc48 (24888420 )84222480
[e88888e0 ]e22222e0 +044v4400 -000v0000 /01248g00 @eh1dlle0 _000000v0 '44800000 =00v0v000 %op248j30
*04lel400 <248g8420 >84212480 ?eh124040
"""
FONT = {entry[0]: entry[1:] for entry in FONT_TABLE.split()} | {" ": "00000000"}
SCALE = 2  # every text at twice the font's size: 10 x 16 pixels a glyph, 12 a step

WIDTH, HEIGHT = 960, 736
LEFT, RIGHT, TOP, BOTTOM = 110, 930, 76, 520  # the plot area
PALETTE = [  # index: white, text, major grid, minor grid, then one colour per series
    (255, 255, 255),
    (30, 30, 30),
    (190, 190, 190),
    (232, 232, 232),
    (0, 114, 178),
    (213, 94, 0),
    (0, 158, 115),
]
WHITE, INK, GRID, MINOR = 0, 1, 2, 3
SERIES = (  # name, legend text, marker, colour; the values: (requests, host µs) per workload row
    ("chunkmeta", "chunkmeta: one StepTablesBuilder.build, the 3 tables", "circle", 4),
    ("vllm", "vLLM 0.33.0: its own functions for the same 3 tables", "square", 5),
    ("fla", "FLA: prepare_chunk_indices + prepare_chunk_offsets (1 table)", "triangle", 6),
)


def series(records: list[dict]) -> tuple[dict, dict]:
    """The latest kept step_tables record with all three series, and the series' points."""

    def points(record):
        rows = record["figures"].get("rows", [])
        try:
            return {
                "chunkmeta": [r["methods"]["chunkmeta_kda_gdn"]["host_idle_us"] for r in rows],
                "vllm": [r["vllm_kda_gdn_step_us"] for r in rows],
                "fla": [r["methods"]["fla_host"]["host_idle_us"] for r in rows],
                "requests": [r["decodes"] + r["prefills"] for r in rows],
            }
        except KeyError:
            return None

    kept = [r for r in records if r["kind"] == "step_tables" and not {"experiment", "flawed"} & set(r) and points(r)]
    if not kept:
        raise ValueError("no step_tables record holds chunkmeta_kda_gdn, vllm_kda_gdn_step_us and fla_host")
    record = max(kept, key=lambda r: r["date"])
    return record, points(record)


# ---------------------------------------------------------------- rasterizing


def _glyph(ch: str) -> np.ndarray:
    if ch not in FONT:
        raise ValueError(f"the picture's font has no {ch!r}")
    rows = [int(c, 32) for c in FONT[ch]]
    bits = np.array([[(row >> (4 - i)) & 1 for i in range(5)] for row in rows], dtype=bool)
    return np.kron(bits, np.ones((SCALE, SCALE), dtype=bool))


def text_width(text: str) -> int:
    return len(text) * 6 * SCALE - SCALE


def text(img: np.ndarray, x: int, y: int, s: str, color: int = INK, *, vertical: bool = False) -> None:
    """``s`` with its top-left corner at (x, y); ``vertical`` reads bottom to top, from (x, y) up."""
    mask = np.zeros((8 * SCALE, text_width(s) + SCALE), dtype=bool)
    for i, ch in enumerate(s):
        mask[:, i * 6 * SCALE : i * 6 * SCALE + 5 * SCALE] = _glyph(ch)
    if vertical:
        mask = np.rot90(mask)
        y -= mask.shape[0]
    img[y : y + mask.shape[0], x : x + mask.shape[1]][mask] = color


def _paint(img: np.ndarray, ys: np.ndarray, xs: np.ndarray, color: int) -> None:
    keep = (ys >= 0) & (ys < img.shape[0]) & (xs >= 0) & (xs < img.shape[1])
    img[ys[keep], xs[keep]] = color


def line(img: np.ndarray, p0, p1, color: int, radius: float = 1.5) -> None:
    """A segment as stamps of a disk every half pixel."""
    steps = int(2 * max(abs(p1[0] - p0[0]), abs(p1[1] - p0[1]))) + 1
    t = np.linspace(0.0, 1.0, steps + 1)
    cx, cy = p0[0] + t * (p1[0] - p0[0]), p0[1] + t * (p1[1] - p0[1])
    r = math.ceil(radius)
    dy, dx = np.mgrid[-r : r + 1, -r : r + 1]
    disk = dx**2 + dy**2 <= radius**2
    xs = np.rint(cx)[:, None].astype(int) + dx[disk][None, :]
    ys = np.rint(cy)[:, None].astype(int) + dy[disk][None, :]
    _paint(img, ys.ravel(), xs.ravel(), color)


def marker(img: np.ndarray, x: float, y: float, shape: str, color: int, size: int = 6) -> None:
    dy, dx = np.mgrid[-size : size + 1, -size : size + 1]
    inside = {
        "circle": dx**2 + dy**2 <= size**2,
        "square": (abs(dx) <= size - 1) & (abs(dy) <= size - 1),
        "triangle": (dy >= -size) & (dy <= size - 1) & (2 * abs(dx) <= dy + size),
    }[shape]
    _paint(img, (round(y) + dy[inside]).ravel(), (round(x) + dx[inside]).ravel(), color)


# ---------------------------------------------------------------- axes


class Box(NamedTuple):
    """A plot area in pixels and the log10 ranges of its axes."""

    left: int
    top: int
    right: int
    bottom: int
    x_lo: float
    x_hi: float
    y_lo: float
    y_hi: float

    def px(self, value: float) -> float:
        return self.left + (math.log10(value) - self.x_lo) / (self.x_hi - self.x_lo) * (self.right - self.left)

    def py(self, value: float) -> float:
        return self.bottom - (math.log10(value) - self.y_lo) / (self.y_hi - self.y_lo) * (self.bottom - self.top)


def _decades(values: list[float], pad: float) -> tuple[float, float]:
    lo, hi = math.log10(min(values)), math.log10(max(values))
    return math.floor(lo - pad + 1e-9), math.ceil(hi + pad - 1e-9)


def log_ticks(lo: float, hi: float, labels=(1,)) -> list[tuple[float, bool, str]]:
    """(value, major, label) for every k * 10^d whose log10 is in [lo, hi]: major where k is 1,
    labelled where k is in ``labels``."""
    ticks = []
    for decade in range(math.floor(lo), math.floor(hi + 1e-9) + 1):
        for k in range(1, 10):
            value = k * 10.0**decade
            if lo - 1e-9 <= math.log10(value) <= hi + 1e-9:
                ticks.append((value, k == 1, f"{k * 10**decade:g}" if k in labels else ""))
    return ticks


def y_grid(img: np.ndarray, box: Box, ticks) -> None:
    for value, major, label in ticks:
        y = round(box.py(value))
        img[y, box.left : box.right] = GRID if major else MINOR
        img[y, box.left - (8 if major else 4) : box.left] = INK
        if label:
            text(img, box.left - 12 - text_width(label), y - 8, label)


def x_grid(img: np.ndarray, box: Box, ticks) -> None:
    for value, major, label in ticks:
        x = round(box.px(value))
        img[box.top : box.bottom, x] = GRID if major else MINOR
        img[box.bottom : box.bottom + (8 if major else 4), x] = INK
        if label:
            text(img, x - text_width(label) // 2, box.bottom + 14, label)


def frame(img: np.ndarray, box: Box) -> None:
    img[box.top : box.bottom, box.left] = img[box.top : box.bottom, box.right] = INK
    img[box.top, box.left : box.right + 1] = img[box.bottom, box.left : box.right + 1] = INK


def polyline(img: np.ndarray, xy: list[tuple[float, float]], shape: str, color: int) -> None:
    """A series: segments between its points, then a marker on each."""
    for a, b in zip(xy, xy[1:], strict=False):
        line(img, a, b, color)
    for x, y in xy:
        marker(img, x, y, shape, color)


def legend_entry(img: np.ndarray, x: int, y: int, shape: str, color: int, label: str) -> None:
    line(img, (x, y), (x + 36, y), color)
    marker(img, x + 18, y, shape, color)
    text(img, x + 50, y - 8, label)


# ---------------------------------------------------------------- the picture


def picture(record: dict, pts: dict) -> np.ndarray:
    img = np.full((HEIGHT, WIDTH), WHITE, dtype=np.uint8)
    values = [v for name, *_ in SERIES for v in pts[name]]
    y_lo, y_hi = _decades(values, 0.0)
    x_lo, x_hi = -0.15, math.log10(max(pts["requests"])) + 0.15
    box = Box(LEFT, TOP, RIGHT, BOTTOM, x_lo, x_hi, y_lo, y_hi)
    y_grid(img, box, log_ticks(y_lo, y_hi))  # µs
    x_grid(img, box, log_ticks(math.ceil(x_lo), x_hi))  # requests
    frame(img, box)
    for name, _, shape, color in SERIES:
        polyline(img, [(box.px(n), box.py(v)) for n, v in zip(pts["requests"], pts[name], strict=True)], shape, color)

    device = record["device"].get("gpu", "?")
    text(img, LEFT, 12, "Host time per step, p50 of calls back to back (log-log)")
    text(img, LEFT, 40, f"record {record['id']}, {device}")
    text(img, 22, (TOP + BOTTOM) // 2 + text_width("host µs per step") // 2, "host µs per step", vertical=True)
    label = "requests in the step (decodes + prefills)"
    text(img, (LEFT + RIGHT - text_width(label)) // 2, BOTTOM + 44, label)
    for i, (_, legend, shape, color) in enumerate(SERIES):
        legend_entry(img, LEFT, BOTTOM + 88 + 26 * i, shape, color, legend)
    steps = ", ".join(f"{r['decodes']}+{r['prefills']}" for r in record["figures"]["rows"])
    text(img, LEFT, BOTTOM + 164, "3 tables: FLA prefill + FLA batch + conv1d, as a Kimi-Linear step")
    text(img, LEFT, BOTTOM + 190, f"steps (decodes + prefills): {steps}")
    return img


# ---------------------------------------------------------------- docs/engine_serving.png

ENGINE_METHODS = (  # name, legend text, marker, colour (vLLM and chunkmeta as in host_time.png)
    ("vllm", "vllm: vLLM 0.33.0's engine, chunkmeta off", "square", 5),
    ("chunkmeta", "chunkmeta: CHUNKMETA_VLLM=1", "circle", 4),
    ("chunkmeta_graphs", "chunkmeta_graphs: and CHUNKMETA_VLLM_FULL_GRAPH=1", "triangle", 6),
)
ENGINE_METRICS = (("mean_ttft_ms", "TTFT, mean ms"), ("mean_tpot_ms", "TPOT, mean ms"))
PANEL_LEFTS, PANEL_WIDTH, PANEL_HEIGHT = (90, 560), 370, 200
PANEL_TOP, PANEL_PITCH = 100, 290  # the first row's top; one model's row to the next


def engine_record(records: list[dict]) -> dict | None:
    """The vllm_engine record RESULTS.md shows (render.latest_record), if it has rows; else None."""
    runs = [r for r in records if r["kind"] == "vllm_engine"]
    record = latest_record(FAMILIES["vllm_engine"], runs) if runs else None
    return record if record and record["figures"].get("rows") else None


def engine_workload(record: dict) -> str:
    """The workload drawn: "short" where the record has it, else its rows' first."""
    workloads = [row["workload"] for row in record["figures"]["rows"]]
    return "short" if "short" in workloads else workloads[0]


def _nice_range(values: list[float]) -> tuple[float, float]:
    """log10 of the largest 1, 2 or 5 x 10^d at or under the least value, and of the smallest at or
    over the greatest (one step wider where they meet)."""
    steps = [
        k * 10.0**d
        for d in range(math.floor(math.log10(min(values))) - 1, math.ceil(math.log10(max(values))) + 2)
        for k in (1, 2, 5)
    ]
    lo = max(v for v in steps if v <= min(values) * (1 + 1e-9))
    hi = min(v for v in steps if v >= max(values) * (1 - 1e-9) and v > lo)
    return math.log10(lo), math.log10(hi)


def engine_panel(img: np.ndarray, left: int, top: int, rows: list[dict], metric: str, title: str) -> None:
    """One model's one metric against concurrency: a series per method, log2 on x, log10 on y."""
    concurrencies = [row["concurrency"] for row in rows]
    series = {
        name: [
            (row["concurrency"], row["methods"][name][metric])
            for row in rows
            if row["methods"].get(name, {}).get(metric, 0) > 0
        ]
        for name, *_ in ENGINE_METHODS
    }
    values = [v for points in series.values() for _, v in points]
    pad = max(0.1, 0.06 * math.log10(max(concurrencies) / min(concurrencies)))
    x_lo, x_hi = math.log10(min(concurrencies)) - pad, math.log10(max(concurrencies)) + pad
    y_lo, y_hi = _nice_range(values) if values else (0.0, 1.0)
    box = Box(left, top, left + PANEL_WIDTH, top + PANEL_HEIGHT, x_lo, x_hi, y_lo, y_hi)
    y_grid(img, box, log_ticks(y_lo, y_hi, (1, 2, 5) if y_hi - y_lo <= 2 else (1,)))
    lo2, hi2 = math.ceil(math.log2(min(concurrencies))), math.floor(math.log2(max(concurrencies)))
    x_grid(img, box, [(c, True, f"{c}") for c in sorted({2**i for i in range(lo2, hi2 + 1)} | set(concurrencies))])
    frame(img, box)
    for name, _, shape, color in ENGINE_METHODS:
        polyline(img, [(box.px(c), box.py(v)) for c, v in sorted(series[name])], shape, color)
    text(img, left, top - 26, title)
    if not values:
        text(img, left + 20, top + 20, "no figures")
    label = "concurrency"
    text(img, left + (PANEL_WIDTH - text_width(label)) // 2, box.bottom + 38, label)


def engine_picture(record: dict) -> np.ndarray:
    """Per model a row of panels, mean TTFT and mean TPOT against concurrency, of one workload."""
    workload = engine_workload(record)
    rows = [row for row in record["figures"]["rows"] if row["workload"] == workload]
    models = list(dict.fromkeys(row["model"] for row in rows))
    shown = [m for m in ENGINE_METHODS if any(m[0] in row["methods"] for row in rows)]
    legend_top = PANEL_TOP + (len(models) - 1) * PANEL_PITCH + PANEL_HEIGHT + 84
    img = np.full((legend_top + 26 * len(shown) + 36, WIDTH), WHITE, dtype=np.uint8)
    for i, model in enumerate(models):
        ours = [row for row in rows if row["model"] == model]
        for left, (metric, name) in zip(PANEL_LEFTS, ENGINE_METRICS, strict=True):
            engine_panel(img, left, PANEL_TOP + i * PANEL_PITCH, ours, metric, f"{model}: {name}")
    device = record["device"].get("gpu", "?")
    text(img, PANEL_LEFTS[0], 12, f"vLLM engine serving, workload {workload} (log-log)")
    text(img, PANEL_LEFTS[0], 40, f"record {record['id']}, {device}")
    for i, (_, legend, shape, color) in enumerate(shown):
        legend_entry(img, PANEL_LEFTS[0], legend_top + 26 * i, shape, color, legend)
    note = "concurrency: requests in flight, a closed loop (vllm bench serve)"
    text(img, PANEL_LEFTS[0], legend_top + 26 * len(shown) + 4, note)
    return img


def png(img: np.ndarray, palette=PALETTE) -> bytes:
    """A palette PNG of ``img``'s indices (8-bit, no filter)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    height, width = img.shape
    raw = np.hstack([np.zeros((height, 1), dtype=np.uint8), img]).tobytes()  # filter 0 per row
    header = struct.pack(">IIBBBBB", width, height, 8, 3, 0, 0, 0)
    return b"".join(
        [
            b"\x89PNG\r\n\x1a\n",
            chunk(b"IHDR", header),
            chunk(b"PLTE", bytes(c for rgb in palette for c in rgb)),
            chunk(b"IDAT", zlib.compress(raw, 9)),
            chunk(b"IEND", b""),
        ]
    )


def same_png(a: bytes, b: bytes) -> bool:
    """The same image: header, palette and pixels (zlib builds may compress them differently)."""

    def parts(data: bytes):
        chunks, at = {}, 8
        while at < len(data):
            (length,) = struct.unpack(">I", data[at : at + 4])
            kind = data[at + 4 : at + 8]
            chunks[kind] = chunks.get(kind, b"") + data[at + 8 : at + 8 + length]
            at += 12 + length
        return chunks.get(b"IHDR"), chunks.get(b"PLTE"), zlib.decompress(chunks.get(b"IDAT", b""))

    try:
        return a[:8] == b[:8] and parts(a) == parts(b)
    except (zlib.error, struct.error):
        return False


def draw(records: list[dict]) -> tuple[bytes, dict]:
    """The picture's PNG and the record it shows."""
    record, pts = series(records)
    return png(picture(record, pts)), record


def draw_engine(records: list[dict]) -> tuple[bytes, dict] | None:
    """docs/engine_serving.png's PNG and the record it shows; None where no vllm_engine record has rows."""
    record = engine_record(records)
    return (png(engine_picture(record)), record) if record else None
