"""docs/host_time.png: host µs per step against requests, log-log, drawn from bench/results/runs.jsonl.

    python bench/results.py render      draws it beside bench/RESULTS.md (render --check verifies it)

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

import numpy as np

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
*04lel400 <248g8420 >84212480
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

    kept = [r for r in records if r["kind"] == "step_tables" and "experiment" not in r and points(r)]
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


# ---------------------------------------------------------------- the picture


def _decades(values: list[float], pad: float) -> tuple[float, float]:
    lo, hi = math.log10(min(values)), math.log10(max(values))
    return math.floor(lo - pad + 1e-9), math.ceil(hi + pad - 1e-9)


def picture(record: dict, pts: dict) -> np.ndarray:
    img = np.full((HEIGHT, WIDTH), WHITE, dtype=np.uint8)
    values = [v for name, *_ in SERIES for v in pts[name]]
    y_lo, y_hi = _decades(values, 0.0)
    x_lo, x_hi = -0.15, math.log10(max(pts["requests"])) + 0.15

    def px(requests: float) -> float:
        return LEFT + (math.log10(requests) - x_lo) / (x_hi - x_lo) * (RIGHT - LEFT)

    def py(us: float) -> float:
        return BOTTOM - (math.log10(us) - y_lo) / (y_hi - y_lo) * (BOTTOM - TOP)

    for decade in range(y_lo, y_hi + 1):  # grid, ticks and labels: µs
        for k in range(1, 10) if decade < y_hi else (1,):
            y = round(py(k * 10.0**decade))
            img[y, LEFT:RIGHT] = GRID if k == 1 else MINOR
            img[y, LEFT - (8 if k == 1 else 4) : LEFT] = INK
        label = f"{10**decade}"
        text(img, LEFT - 12 - text_width(label), round(py(10.0**decade)) - 8, label)
    for decade in range(math.ceil(x_lo), math.floor(x_hi) + 1):  # requests
        for k in range(1, 10):
            if math.log10(k * 10.0**decade) <= x_hi:
                x = round(px(k * 10.0**decade))
                img[TOP:BOTTOM, x] = GRID if k == 1 else MINOR
                img[BOTTOM : BOTTOM + (8 if k == 1 else 4), x] = INK
        label = f"{10**decade}"
        text(img, round(px(10.0**decade)) - text_width(label) // 2, BOTTOM + 14, label)
    img[TOP:BOTTOM, LEFT] = img[TOP:BOTTOM, RIGHT] = INK  # the frame
    img[TOP, LEFT : RIGHT + 1] = img[BOTTOM, LEFT : RIGHT + 1] = INK

    for name, _, shape, color in SERIES:
        xy = [(px(n), py(v)) for n, v in zip(pts["requests"], pts[name], strict=True)]
        for a, b in zip(xy, xy[1:], strict=False):
            line(img, a, b, color)
        for x, y in xy:
            marker(img, x, y, shape, color)

    device = record["device"].get("gpu", "?")
    text(img, LEFT, 12, "Host time per step, p50 of calls back to back (log-log)")
    text(img, LEFT, 40, f"record {record['id']}, {device}")
    text(img, 22, (TOP + BOTTOM) // 2 + text_width("host µs per step") // 2, "host µs per step", vertical=True)
    label = "requests in the step (decodes + prefills)"
    text(img, (LEFT + RIGHT - text_width(label)) // 2, BOTTOM + 44, label)
    for i, (_, legend, shape, color) in enumerate(SERIES):
        y = BOTTOM + 88 + 26 * i
        line(img, (LEFT, y), (LEFT + 36, y), color)
        marker(img, LEFT + 18, y, shape, color)
        text(img, LEFT + 50, y - 8, legend)
    steps = ", ".join(f"{r['decodes']}+{r['prefills']}" for r in record["figures"]["rows"])
    text(img, LEFT, BOTTOM + 164, "3 tables: FLA prefill + FLA batch + conv1d, as a Kimi-Linear step")
    text(img, LEFT, BOTTOM + 190, f"steps (decodes + prefills): {steps}")
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
