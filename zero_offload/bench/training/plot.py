"""Line charts as PNG files for benchmark reports: matplotlib when it is installed, else a
small rasterizer of our own (axes, ticks, curves and a legend in a 3x5 pixel font), so that
a report needs no plotting dependency."""

from __future__ import annotations

import math
import struct
import zlib
from typing import Mapping, Sequence

import numpy as np

__all__ = ["line_plot"]

Series = Mapping[str, Sequence[tuple[float, float]]]

# fmt: off
_FONT = {  # 3 columns x 5 rows, rows split by "/" ("#" on)
    "0": "###/#.#/#.#/#.#/###", "1": ".#./##./.#./.#./###", "2": "###/..#/###/#../###",
    "3": "###/..#/###/..#/###", "4": "#.#/#.#/###/..#/..#", "5": "###/#../###/..#/###",
    "6": "###/#../###/#.#/###", "7": "###/..#/..#/.#./.#.", "8": "###/#.#/###/#.#/###",
    "9": "###/#.#/###/..#/###", ".": ".../.../.../.../.#.", "-": ".../.../###/.../...",
    "+": ".../.#./###/.#./...", "_": ".../.../.../.../###", " ": ".../.../.../.../...",
    "(": ".#./#../#../#../.#.", ")": ".#./..#/..#/..#/.#.", "/": "..#/..#/.#./#../#..",
    "%": "#.#/..#/.#./#../#.#", ":": ".../.#./.../.#./...", ",": ".../.../.../.#./#..",
    "a": ".#./#.#/###/#.#/#.#", "b": "##./#.#/##./#.#/##.", "c": ".##/#../#../#../.##",
    "d": "##./#.#/#.#/#.#/##.", "e": "###/#../##./#../###", "f": "###/#../##./#../#..",
    "g": ".##/#../#.#/#.#/.##", "h": "#.#/#.#/###/#.#/#.#", "i": "###/.#./.#./.#./###",
    "j": "..#/..#/..#/#.#/.#.", "k": "#.#/#.#/##./#.#/#.#", "l": "#../#../#../#../###",
    "m": "#.#/###/###/#.#/#.#", "n": "##./#.#/#.#/#.#/#.#", "o": ".#./#.#/#.#/#.#/.#.",
    "p": "##./#.#/##./#../#..", "q": ".#./#.#/#.#/##./.##", "r": "##./#.#/##./#.#/#.#",
    "s": ".##/#../.#./..#/##.", "t": "###/.#./.#./.#./.#.", "u": "#.#/#.#/#.#/#.#/###",
    "v": "#.#/#.#/#.#/#.#/.#.", "w": "#.#/#.#/###/###/#.#", "x": "#.#/#.#/.#./#.#/#.#",
    "y": "#.#/#.#/.#./.#./.#.", "z": "###/..#/.#./#../###",
}
_GLYPHS = {k: v.replace("/", "") for k, v in _FONT.items()}
# fmt: on
_COLORS = [
    (31, 119, 180),
    (255, 127, 14),
    (44, 160, 44),
    (214, 39, 40),
    (148, 103, 189),
    (140, 86, 75),
    (227, 119, 194),
    (127, 127, 127),
    (188, 189, 34),
    (23, 190, 207),
]


def _png(path: str, img: np.ndarray) -> None:
    h, w, _ = img.shape
    raw = b"".join(b"\x00" + img[y].astype(np.uint8).tobytes() for y in range(h))

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))

    with open(path, "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\n")
        f.write(chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)))
        f.write(chunk(b"IDAT", zlib.compress(raw, 9)))
        f.write(chunk(b"IEND", b""))


def _text(img: np.ndarray, x: int, y: int, s: str, color=(0, 0, 0), scale: int = 3) -> None:
    for ch in s.lower():
        glyph = _GLYPHS.get(ch, _GLYPHS[" "])
        for i, on in enumerate(glyph):
            if on == "#":
                r, c = divmod(i, 3)
                y0, x0 = y + r * scale, x + c * scale
                img[y0 : y0 + scale, x0 : x0 + scale] = color
        x += 4 * scale


def _line(
    img: np.ndarray, x0: float, y0: float, x1: float, y1: float, color, width: int = 2
) -> None:
    n = int(max(abs(x1 - x0), abs(y1 - y0))) + 1
    xs = np.linspace(x0, x1, n).round().astype(int)
    ys = np.linspace(y0, y1, n).round().astype(int)
    h, w, _ = img.shape
    for dx in range(width):
        for dy in range(width):
            xx, yy = np.clip(xs + dx, 0, w - 1), np.clip(ys + dy, 0, h - 1)
            img[yy, xx] = color


def _ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    span = hi - lo or 1.0
    raw = span / count
    mag = 10 ** math.floor(math.log10(raw))
    step = min((m * mag for m in (1, 2, 5, 10) if m * mag >= raw), default=mag * 10)
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step) + 1)]


def _own(path: str, series: Series, xlabel: str, ylabel: str, title: str) -> None:
    w, h, left, right, top, bottom = 1000, 600, 80, 330, 64, 56
    img = np.full((h, w, 3), 255, dtype=np.uint8)
    pts = [p for s in series.values() for p in s]
    xlo, xhi = min(p[0] for p in pts), max(p[0] for p in pts)
    ylo, yhi = min(p[1] for p in pts), max(p[1] for p in pts)
    pad = (yhi - ylo) * 0.05 or 0.1
    ylo, yhi = ylo - pad, yhi + pad

    def px(x: float, y: float) -> tuple[float, float]:
        fx = left + (x - xlo) / ((xhi - xlo) or 1) * (w - left - right)
        fy = h - bottom - (y - ylo) / (yhi - ylo) * (h - top - bottom)
        return fx, fy

    for t in _ticks(ylo, yhi):
        _, y = px(xlo, t)
        _line(img, left, y, w - right, y, (225, 225, 225), 1)
        _text(img, 5, int(y) - 7, f"{t:.4g}")
    for t in _ticks(xlo, xhi):
        x, _ = px(t, ylo)
        _line(img, x, top, x, h - bottom, (235, 235, 235), 1)
        _text(img, int(x) - 10, h - bottom + 8, f"{t:.4g}")
    _line(img, left, h - bottom, w - right, h - bottom, (0, 0, 0), 1)
    _line(img, left, top, left, h - bottom, (0, 0, 0), 1)
    for i, (name, s) in enumerate(series.items()):
        color = _COLORS[i % len(_COLORS)]
        ps = [px(x, y) for x, y in s]
        for (x0, y0), (x1, y1) in zip(ps, ps[1:]):
            _line(img, x0, y0, x1, y1, color)
        ly = top + 20 * i
        _line(img, w - right + 10, ly + 4, w - right + 30, ly + 4, color, 3)
        _text(img, w - right + 36, ly, name[:24])
    _text(img, left, 12, title[:100])
    _text(img, (w - right) // 2, h - 22, xlabel)
    _text(img, 5, 38, ylabel)
    _png(path, img)


def line_plot(
    path: str, series: Series, *, xlabel: str = "", ylabel: str = "", title: str = ""
) -> None:
    """Write ``series`` (name -> [(x, y), ...]) as a line chart PNG at ``path``."""
    try:
        import matplotlib  # type: ignore[import-not-found]

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # type: ignore[import-not-found]
    except ImportError:
        _own(path, series, xlabel, ylabel, title)
        return
    fig, ax = plt.subplots(figsize=(9, 5.6))
    for name, s in series.items():
        ax.plot([p[0] for p in s], [p[1] for p in s], label=name)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize="small")
    ax.grid(alpha=0.3)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
