"""Lossless delta codec for observation batches (the ``state_diff=True`` wire format).

Consecutive observations differ little, so we send differences along the first (time) axis instead of the
values. Differences are taken on the raw bits (the array viewed as unsigned integers, wrapping subtraction),
so decoding is bit-exact for every dtype and value, NaN and -0.0 included. The difference bytes are then
shuffled (all first bytes, then all second bytes, ...) so zstd sees long runs, and compressed. The plain array
is compressed too and the smaller frame is sent: on rendered frames zstd's own long matches against the
previous frame beat the deltas (measured in ``bench/state_diff_bytes.py``), on float state vectors the deltas win.

Layout: ``b"OTSD" | u8 version | u32 header length | JSON header | zstd frame``. A structured observation (a dict or
tuple of arrays: gymnasium's Dict/Tuple spaces) is one frame per leaf, each leaf in its own dtype (uint8 images stay
uint8): the header names the structure and each leaf frame's length, the leaf frames follow.
"""

from __future__ import annotations

import json
import struct

import numpy as np
import zstandard

_MAGIC = b"OTSD"
_VERSION = 1
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def encode_observations(arr: np.ndarray | dict | tuple, level: int = 3) -> bytes:
    """Encode an array (time first), or a dict / tuple of them, into compressed bit-level deltas;
    ``decode_observations`` inverts it."""
    if isinstance(arr, (dict, tuple)):
        keys = list(arr) if isinstance(arr, dict) else None
        frames = [encode_observations(leaf, level) for leaf in (arr.values() if keys is not None else arr)]
        return _frame(
            {"tree": "dict" if keys is not None else "tuple", "keys": keys, "sizes": list(map(len, frames))},
            b"".join(frames),
        )
    arr = np.asarray(arr)
    arr = arr if arr.flags.c_contiguous else np.ascontiguousarray(arr)
    if arr.dtype.hasobject:
        raise TypeError(
            f"encode_observations: dtype {arr.dtype} holds Python objects; expected a numeric or bool array"
        )
    compress = zstandard.ZstdCompressor(level=level).compress
    body, delta = compress(arr.tobytes()), False
    itemsize = arr.dtype.itemsize
    if itemsize in _UINT and arr.ndim > 0:
        bits = arr.view(_UINT[itemsize])
        diffs = bits.copy()
        np.subtract(bits[1:], bits[:-1], out=diffs[1:])
        delta_body = compress(diffs.view(np.uint8).reshape(-1, itemsize).T.tobytes())
        if len(delta_body) < len(body):
            body, delta = delta_body, True
    return _frame({"dtype": arr.dtype.str, "shape": list(arr.shape), "delta": delta}, body)


def _frame(header: dict, body: bytes) -> bytes:
    encoded = json.dumps(header).encode()
    return _MAGIC + struct.pack("<BI", _VERSION, len(encoded)) + encoded + body


def decode_observations(data: bytes) -> np.ndarray | dict | tuple:
    """Inverse of ``encode_observations``: the original array (or dict / tuple of arrays), bit for bit."""
    if data[:4] != _MAGIC:
        raise ValueError("decode_observations: not a state_diff payload (bad magic bytes)")
    version, header_len = struct.unpack_from("<BI", data, 4)
    if version != _VERSION:
        raise ValueError(f"decode_observations: unsupported version {version}, expected {_VERSION}")
    start = 4 + struct.calcsize("<BI")
    header = json.loads(data[start : start + header_len])
    if "tree" in header:
        leaves, offset = [], start + header_len
        for size in header["sizes"]:
            leaves.append(decode_observations(data[offset : offset + size]))
            offset += size
        return dict(zip(header["keys"], leaves)) if header["tree"] == "dict" else tuple(leaves)
    dtype, shape = np.dtype(header["dtype"]), tuple(header["shape"])
    raw = zstandard.ZstdDecompressor().decompress(data[start + header_len :])
    if not header["delta"]:
        return np.frombuffer(raw, dtype=dtype).reshape(shape).copy()
    itemsize = dtype.itemsize
    diffs = np.ascontiguousarray(np.frombuffer(raw, dtype=np.uint8).reshape(itemsize, -1).T)
    diffs = diffs.view(_UINT[itemsize]).reshape(shape)
    return np.cumsum(diffs, axis=0, dtype=_UINT[itemsize]).view(dtype)
