"""A PNG decoder small enough to trust (8-bit RGB/RGBA, every row filter), so the
dashboard's screenshot test can check that real pixels rendered (tests/api/test_dashboard.py,
which also tests the decoder against an image encoded by hand)."""

from __future__ import annotations

import struct
import zlib

import numpy as np


def png_rgb(data: bytes) -> np.ndarray:
    """The pixels (height x width x RGB) of an 8-bit, non-interlaced RGB or RGBA PNG."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, header = 8, b"", None
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        pos += 12 + length
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat += body
    assert header is not None
    width, height, depth, color, _, _, interlace = header
    assert depth == 8 and color in (2, 6) and interlace == 0, header
    bpp = 3 if color == 2 else 4
    raw = np.frombuffer(zlib.decompress(idat), np.uint8).reshape(height, width * bpp + 1)
    out = np.zeros((height, width * bpp), np.uint8)
    prev = np.zeros(width * bpp, np.uint8)
    for y in range(height):
        kind, line = raw[y, 0], raw[y, 1:]
        if kind == 0:
            prev = line
        elif kind == 1:  # Sub: a running sum along the row, per channel
            prev = np.cumsum(line.reshape(width, bpp), axis=0, dtype=np.uint8).reshape(-1)
        elif kind == 2:  # Up
            prev = line + prev
        else:  # Average, Paeth: byte by byte
            prev = np.frombuffer(_unfilter(kind, bytearray(line), prev.tobytes(), bpp), np.uint8)
        out[y] = prev
    return out.reshape(height, width, bpp)[:, :, :3]


def _unfilter(kind: int, line: bytearray, prev: bytes, bpp: int) -> bytearray:
    for i in range(len(line)):
        a = line[i - bpp] if i >= bpp else 0
        b = prev[i]
        if kind == 3:
            line[i] = (line[i] + (a + b) // 2) & 0xFF
            continue
        c = prev[i - bpp] if i >= bpp else 0
        p = a + b - c
        pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
        line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 0xFF
    return line


def assert_real_screenshot(data: bytes) -> None:
    assert len(data) > 20_000, f"screenshot is only {len(data)} bytes"
    pixels = png_rgb(data)
    height, width, _ = pixels.shape
    assert width >= 1000 and height >= 800
    packed = pixels.astype(np.uint32) @ np.array([1 << 16, 1 << 8, 1], np.uint32)
    colors = np.unique(packed)
    # Text, charts, badges and the dark header: a blank or unstyled page has a handful.
    assert len(colors) > 50, f"only {len(colors)} colours in the screenshot"
    dark = (pixels.max(axis=2) < 60).mean()
    assert 0.01 < dark < 0.9, f"{dark:.1%} of the page is dark: header and text did not render"
