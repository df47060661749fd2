"""Bar charts written as PNG with the standard library alone (zlib and struct): the benchmark
command and the README's plot need no plotting package, on a GPU machine without network
access too. A canvas of RGB pixels, filled rectangles and a 5x7 pixel font of our own (upper
case, digits and the punctuation numbers and labels use), drawn at a whole-pixel scale."""

from __future__ import annotations

import struct
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

RGB = tuple[int, int, int]
# Each glyph: 7 rows of 5 pixels, a row written as 5 bits (1: ink), top row first.
_FONT_ROWS = {
    "0": "01110 10001 10011 10101 11001 10001 01110", "1": "00100 01100 00100 00100 00100 00100 01110",
    "2": "01110 10001 00001 00010 00100 01000 11111", "3": "11111 00010 00100 00010 00001 10001 01110",
    "4": "00010 00110 01010 10010 11111 00010 00010", "5": "11111 10000 11110 00001 00001 10001 01110",
    "6": "00110 01000 10000 11110 10001 10001 01110", "7": "11111 00001 00010 00100 01000 01000 01000",
    "8": "01110 10001 10001 01110 10001 10001 01110", "9": "01110 10001 10001 01111 00001 00010 01100",
    "A": "01110 10001 10001 11111 10001 10001 10001", "B": "11110 10001 10001 11110 10001 10001 11110",
    "C": "01110 10001 10000 10000 10000 10001 01110", "D": "11100 10010 10001 10001 10001 10010 11100",
    "E": "11111 10000 10000 11110 10000 10000 11111", "F": "11111 10000 10000 11110 10000 10000 10000",
    "G": "01110 10001 10000 10111 10001 10001 01111", "H": "10001 10001 10001 11111 10001 10001 10001",
    "I": "01110 00100 00100 00100 00100 00100 01110", "J": "00111 00010 00010 00010 00010 10010 01100",
    "K": "10001 10010 10100 11000 10100 10010 10001", "L": "10000 10000 10000 10000 10000 10000 11111",
    "M": "10001 11011 10101 10101 10001 10001 10001", "N": "10001 10001 11001 10101 10011 10001 10001",
    "O": "01110 10001 10001 10001 10001 10001 01110", "P": "11110 10001 10001 11110 10000 10000 10000",
    "Q": "01110 10001 10001 10001 10101 10010 01101", "R": "11110 10001 10001 11110 10100 10010 10001",
    "S": "01111 10000 10000 01110 00001 00001 11110", "T": "11111 00100 00100 00100 00100 00100 00100",
    "U": "10001 10001 10001 10001 10001 10001 01110", "V": "10001 10001 10001 10001 10001 01010 00100",
    "W": "10001 10001 10001 10101 10101 10101 01010", "X": "10001 10001 01010 00100 01010 10001 10001",
    "Y": "10001 10001 10001 01010 00100 00100 00100", "Z": "11111 00001 00010 00100 01000 10000 11111",
    " ": "00000 00000 00000 00000 00000 00000 00000", ".": "00000 00000 00000 00000 00000 01100 01100",
    ",": "00000 00000 00000 00000 01100 00100 01000", "/": "00000 00001 00010 00100 01000 10000 00000",
    ":": "00000 01100 01100 00000 01100 01100 00000", "-": "00000 00000 00000 11111 00000 00000 00000",
    "(": "00010 00100 01000 01000 01000 00100 00010", ")": "01000 00100 00010 00010 00010 00100 01000",
    "%": "11000 11001 00010 00100 01000 10011 00011", "+": "00000 00100 00100 11111 00100 00100 00000",
    "_": "00000 00000 00000 00000 00000 00000 11111", "=": "00000 00000 11111 00000 11111 00000 00000",
    "?": "01110 10001 00001 00010 00100 00000 00100",
}
FONT = {c: [int(r, 2) for r in rows.split()] for c, rows in _FONT_ROWS.items()}
WHITE, BLACK, GREY = (255, 255, 255), (30, 30, 30), (200, 200, 200)
COLOURS = [(46, 110, 180), (230, 140, 40), (80, 160, 90), (170, 70, 160)]


class Canvas:
    def __init__(self, width: int, height: int, background: RGB = WHITE) -> None:
        self.width, self.height = width, height
        self.px = bytearray(bytes(background) * (width * height))  # row-major RGB

    def rect(self, x0: int, y0: int, x1: int, y1: int, colour: RGB) -> None:
        """Fill [x0, x1) x [y0, y1), clipped to the canvas."""
        x0, x1 = max(0, min(x0, x1)), min(self.width, max(x0, x1))
        y0, y1 = max(0, min(y0, y1)), min(self.height, max(y0, y1))
        if x0 >= x1:
            return
        row = bytes(colour) * (x1 - x0)
        for y in range(y0, y1):
            i = (y * self.width + x0) * 3
            self.px[i:i + len(row)] = row

    def text(self, x: int, y: int, s: str, colour: RGB = BLACK, scale: int = 2, anchor: str = "left") -> None:
        """``s`` (upper-cased; characters without a glyph drawn as '?') with its top at ``y``;
        ``anchor`` 'left', 'centre' or 'right' of ``x``."""
        s = s.upper()
        w = text_width(s, scale)
        x -= w // 2 if anchor == "centre" else w if anchor == "right" else 0
        for ch in s:
            for r, bits in enumerate(FONT.get(ch, FONT["?"])):
                for c in range(5):
                    if bits >> (4 - c) & 1:
                        self.rect(x + c * scale, y + r * scale, x + (c + 1) * scale, y + (r + 1) * scale, colour)
            x += 6 * scale

    def png(self) -> bytes:
        raw = b"".join(b"\x00" + bytes(self.px[y * self.width * 3:(y + 1) * self.width * 3])
                       for y in range(self.height))  # filter 0 (none) on every row

        def chunk(kind: bytes, data: bytes) -> bytes:
            return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

        ihdr = struct.pack(">IIBBBBB", self.width, self.height, 8, 2, 0, 0, 0)  # 8-bit RGB
        return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")


def text_width(s: str, scale: int = 2) -> int:
    return max(len(s) * 6 - 1, 0) * scale


@dataclass
class Panel:
    """One bar chart: a group of bars per label, one bar per series (None: no bar)."""

    title: str
    labels: list[str]
    series: list[tuple[str, list[float | None]]]
    fmt: Callable[[float], str] = field(default=lambda v: f"{v:,.0f}")


def bar_chart_png(panels: Sequence[Panel], title: str = "", panel_width: int = 460, height: int = 400) -> bytes:
    """The panels side by side under ``title``, a legend when a panel has several series."""
    c = Canvas(panel_width * len(panels), height)
    if title:
        c.text(c.width // 2, 10, title, anchor="centre")
    for p_i, p in enumerate(panels):
        left, top, bottom = p_i * panel_width + 30, 70, height - 50
        right = (p_i + 1) * panel_width - 20
        c.text((left + right) // 2, 40, p.title, anchor="centre")
        values = [v for _, vs in p.series for v in vs if v is not None]
        peak = max(values, default=1.0) or 1.0
        c.rect(left, bottom, right, bottom + 2, BLACK)  # the axis
        for frac in (0.25, 0.5, 0.75, 1.0):  # grid lines
            y = bottom - int((bottom - top - 20) * frac)
            c.rect(left, y, right, y + 1, GREY)
        group_w = (right - left) // max(len(p.labels), 1)
        bar_w = max(4, (group_w - 16) // max(len(p.series), 1))
        for g, label in enumerate(p.labels):
            x = left + g * group_w + 8
            for s_i, (_, vs) in enumerate(p.series):
                v = vs[g]
                if v is None:
                    continue
                h = int((bottom - top - 20) * v / peak)
                colour = COLOURS[s_i % len(COLOURS)]
                c.rect(x + s_i * bar_w, bottom - h, x + (s_i + 1) * bar_w - 2, bottom, colour)
                c.text(x + s_i * bar_w + bar_w // 2, bottom - h - 12, p.fmt(v), scale=1, anchor="centre")
            scale = 2 if text_width(label, 2) < group_w - 4 else 1  # many groups: the small font
            c.text(left + g * group_w + group_w // 2, bottom + 10, label, scale=scale, anchor="centre")
        if len(p.series) > 1:
            y = bottom + 30
            x = left
            for s_i, (name, _) in enumerate(p.series):
                c.rect(x, y, x + 10, y + 10, COLOURS[s_i % len(COLOURS)])
                c.text(x + 14, y + 2, name, scale=1)
                x += 24 + text_width(name, 1)
    return c.png()
