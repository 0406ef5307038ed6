"""A long input's reduced weights (:mod:`qkv.viz.long_inputs`) packed for the page, layer by layer.

Inside the page, a reduced form's three arrays are binary instead of nested lists:

* ``index`` (key positions) and ``weight`` (in units of 1/10,000: the document's weights have 4
  decimals, so this is exact) as uint16, one base64 text of zlib-compressed bytes per layer (per
  entry of the first axis), all high bytes of the layer first, then its low bytes;
* ``blocks`` (block means) as little-endian float32, one zlib-compressed base64 text.

core.js inflates ``blocks`` when the page opens (the model view draws every layer from them) and a
layer's ``index`` and ``weight`` only when that layer is first shown, so a 4,096-token page's first
picture waits for one layer, not all of them. Layout::

    {"packed": "qkv-layers/1", "dtype": "uint16" | "float32", "shape": [...], "scale": 10000 | 1,
     "layers": [base64 text per entry of the first axis]}
"""

from __future__ import annotations

import base64
import zlib
from typing import Any

import numpy as np

LAYERS = "qkv-layers/1"
SCALE = 10_000  # the reduced weights' 4 decimals


def _chunk(data: bytes) -> str:
    """zlib-compressed ``data`` as base64 text."""
    return base64.b64encode(zlib.compress(data, 6)).decode("ascii")


def _planes(words: np.ndarray) -> bytes:
    """uint16 values as all their high bytes, then all their low bytes (they compress better)."""
    flat = words.astype(np.uint16).ravel()
    return np.concatenate([(flat >> 8).astype(np.uint8), (flat & 0xFF).astype(np.uint8)]).tobytes()


def pack_layers(values: np.ndarray, *, dtype: str, scale: int = 1) -> dict[str, Any]:
    """``values`` (first axis: layers) packed as one chunk per layer (``dtype`` "uint16": ``values *
    scale`` must be integers from 0 to 65,535) or as one chunk (``dtype`` "float32")."""
    if dtype == "uint16":
        units = np.rint(np.asarray(values, dtype=np.float64) * scale)
        if units.size and (units.min() < 0 or units.max() > np.iinfo(np.uint16).max):
            raise ValueError("values do not fit in uint16")
        layers = [_chunk(_planes(layer)) for layer in units]
    elif dtype == "float32":
        layers = [_chunk(np.asarray(values, dtype="<f4").tobytes())]
    else:
        raise ValueError(f"unknown dtype {dtype!r}")
    return {"packed": LAYERS, "dtype": dtype, "shape": list(np.shape(values)), "scale": scale, "layers": layers}


def unpack_layers(packed: dict[str, Any]) -> np.ndarray:
    """The values :func:`pack_layers` packed, as the page reads them (float64 here)."""
    if not isinstance(packed, dict) or packed.get("packed") != LAYERS:
        raise ValueError(f"not packed layers ({LAYERS}): {str(packed)[:80]}")
    shape = tuple(packed["shape"])
    raw = [zlib.decompress(base64.b64decode(chunk)) for chunk in packed["layers"]]
    if packed["dtype"] == "float32":
        return np.frombuffer(b"".join(raw), dtype="<f4").astype(np.float64).reshape(shape)
    out = []
    for data in raw:
        planes = np.frombuffer(data, dtype=np.uint8)
        n = planes.size // 2
        out.append((planes[:n].astype(np.uint16) << 8 | planes[n:]) / packed["scale"])
    return np.stack(out).reshape(shape)


def pack_reduced(reduced: dict[str, Any]) -> dict[str, Any]:
    """A reduced form (:func:`qkv.viz.long_inputs.reduce_weights`) with its arrays packed for the page."""
    return dict(
        reduced,
        index=pack_layers(np.asarray(reduced["index"]), dtype="uint16"),
        weight=pack_layers(np.asarray(reduced["weight"]), dtype="uint16", scale=SCALE),
        blocks=pack_layers(np.asarray(reduced["blocks"]), dtype="float32"),
    )


def unpack_reduced(packed: dict[str, Any]) -> dict[str, Any]:
    """The reduced form inside a page, its arrays back as nested lists (block means as float32)."""
    out = dict(packed)
    for key in ("index", "weight", "blocks"):
        values = unpack_layers(packed[key])
        out[key] = (values.astype(np.int64) if key == "index" else values).tolist()
    return out
