"""One self-contained HTML page: the explorer's markup, CSS, JavaScript and data, all inline.

Nothing is fetched from a network: the page's Content-Security-Policy forbids every source but
the page itself (and, in live mode, requests back to the local server that served it). The data
sits in a ``<script type="application/json">`` element that the JavaScript parses; it is never
pasted into code.

Inside the page (only there: ``qkv attend --json`` and ``qkv serve``'s answers stay plain JSON) the
large arrays, each view's ``"attention"`` ``[L][H][s_q][s_k]`` and ``"rollout"`` ``[L][s_q][s_k]``, are
packed (:func:`pack_weights`): a 512-token sentence has 6 x 12 x 512 x 512 weights, about 120 MB as
JSON text, 9 MB packed. core.js unpacks them into ``Float32Array`` rows before the first draw.
A long input's reduced form (:mod:`qkv.viz.long_inputs`) is packed layer by layer
(:mod:`qkv.viz.page_long`); core.js decodes a layer when it is first shown.
"""

from __future__ import annotations

import base64
import hashlib
import html
import json
import zlib
from importlib import resources
from pathlib import Path

import numpy as np

from qkv.runtime.fileio import write_text
from qkv.viz.export import check_data
from qkv.viz.long_inputs import is_reduced
from qkv.viz.page_long import pack_reduced, unpack_reduced

# The page's JavaScript, inlined in this order into one <script> (core.js first: it makes the
# shared object the others add to; main.js last: it starts the page).
SCRIPTS = (
    "core.js",
    "figure.js",
    "lines.js",
    "longlines.js",
    "longview.js",
    "attention.js",
    "summary.js",
    "rollout.js",
    "scores.js",
    "saliency.js",
    "lens.js",
    "attribution.js",
    "compare.js",
    "export.js",
    "main.js",
)

# The page's policy: nothing from anywhere, the one inline script allowed by its hash (so a script or
# an on* handler that got into the page some other way would not run), styles inline, images as data.
_CSP_STATIC = (
    "default-src 'none'; style-src 'unsafe-inline'; script-src '{script_hash}'; img-src data:; "
    "base-uri 'none'; form-action 'none'"
)
_CSP_LIVE = _CSP_STATIC + "; connect-src 'self'"
_DATA_OPEN = '<script id="qkv-data" type="application/json">'


def static_text(name: str) -> str:
    """The text of a file shipped under ``qkv/viz/static/``."""
    return resources.files("qkv.viz").joinpath("static", name).read_text(encoding="utf-8")


def json_for_script(data: dict) -> str:
    """JSON that is safe inside a ``<script>`` element: ``<``, ``>``, ``&`` and the JavaScript line
    separators are escaped, so text such as ``</script>`` in a sentence cannot end the element."""
    text = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    for raw in ("<", ">", "&", "\u2028", "\u2029"):
        text = text.replace(raw, f"\\u{ord(raw):04x}")
    return text


PACKED = "qkv-weights/1"
WEIGHT_SCALE = 10_000  # the document's weights have 4 decimals (AttentionView.to_dict, analysis.rounded)
LINE_FLOOR = 100  # 0.01 in 1/WEIGHT_SCALE units: lines.js draws no line for a weight below 0.01
SMALL_STEP = 5  # below LINE_FLOOR, weights are rounded to multiples of 0.0005 (within 0.0002)


def pack_weights(grid: list) -> dict | None:
    """Nested lists of attention weights packed for the page, or None when they cannot be (then the
    page keeps the JSON lists).

    The weights are stored as integers in units of 1/10,000 (the document rounds to 4 decimals, so
    this is exact): uint16, the high bytes of all of them then the low bytes, zlib-compressed
    (the browser's ``DecompressionStream("deflate")`` inflates it), base64 text. Weights of 0.01
    and more, every line the page draws, keep all their digits; smaller ones, which only tint the
    model view's heatmaps and the shading of a hovered token's partners, are rounded to a
    multiple of 0.0005 (0.0099 in place of 0.01), changing them by at most 0.0002 and never to
    0.01 or more, so a line appears in the page exactly where the JSON has a weight of at least
    0.01. Compressed, those small weights' last digits were most of the bytes (a 512-token
    MiniLM sentence's 6 x 12 heads: 10.6 MB with them, 6.6 MB without).

    Args:
        grid: rectangular nested lists of numbers (a view's ``attention`` or ``rollout``).

    Returns:
        ``{"packed": "qkv-weights/1", "shape": [...], "scale": 10000, "data": base64 text}``, or
        None when a value is negative, above 6.5535 or not a multiple of 0.0001.

    Shape:
        ``shape`` is the grid's, e.g. ``(L, H, s_q, s_k)``; the data holds ``2 * prod(shape)`` bytes
        inflated, in row-major order.
    """
    values = np.asarray(grid, dtype=np.float64)
    units = np.rint(values * WEIGHT_SCALE)
    if values.size == 0 or not (
        units.min() >= 0 and units.max() <= np.iinfo(np.uint16).max and np.array_equal(units / WEIGHT_SCALE, values)
    ):
        return None
    small = units < LINE_FLOOR
    units[small] = np.minimum(np.rint(units[small] / SMALL_STEP) * SMALL_STEP, LINE_FLOOR - 1)
    words = units.astype(np.uint16).ravel()
    planes = np.concatenate([(words >> 8).astype(np.uint8), (words & 0xFF).astype(np.uint8)])  # compress better
    return {
        "packed": PACKED,
        "shape": list(values.shape),
        "scale": WEIGHT_SCALE,
        "data": base64.b64encode(zlib.compress(planes.tobytes(), 6)).decode("ascii"),
    }


def packed_for_page(data: dict) -> dict:
    """``data`` with each view's ``attention`` and ``rollout`` packed (:func:`pack_weights`, or for a
    long input's reduced form :func:`qkv.viz.page_long.pack_reduced`); the caller's document is left
    as it was (the changed parts are copies)."""
    examples = []
    for example in data.get("examples") or []:
        views = []
        for view in example.get("views") or []:
            view = dict(view)
            for key in ("attention", "rollout"):
                if key in view and is_reduced(view[key]):
                    view[key] = pack_reduced(view[key])
                    continue
                packed = pack_weights(view[key]) if key in view else None
                if packed is not None:
                    view[key] = packed
            views.append(view)
        examples.append(dict(example, views=views))
    return dict(data, examples=examples)


def unpack_weights(packed: dict) -> np.ndarray:
    """The weights that :func:`pack_weights` packed, as the page unpacks them (float64 here).

    Shape:
        ``packed["shape"]``.
    """
    if not isinstance(packed, dict) or packed.get("packed") != PACKED:
        raise ValueError(f"not packed weights ({PACKED}): {str(packed)[:80]}")
    shape = tuple(packed["shape"])
    planes = np.frombuffer(zlib.decompress(base64.b64decode(packed["data"])), dtype=np.uint8)
    n = int(np.prod(shape))
    if planes.size != 2 * n:
        raise ValueError(f"packed weights of shape {shape} hold {planes.size} bytes, not {2 * n}")
    words = planes[:n].astype(np.uint16) << 8 | planes[n:]
    return (words / packed["scale"]).reshape(shape)


def page_document(page: str) -> dict:
    """The document inside a page from :func:`render_html`, packed arrays unpacked to nested lists
    (the weights below 0.01 as rounded for the page, see :func:`pack_weights`)."""
    start = page.index(_DATA_OPEN) + len(_DATA_OPEN)
    data = json.loads(page[start : page.index("</script>", start)])
    for example in data.get("examples") or []:
        for view in example.get("views") or []:
            for key in ("attention", "rollout"):
                if is_reduced(view.get(key)):
                    view[key] = unpack_reduced(view[key])
                elif isinstance(view.get(key), dict):
                    view[key] = unpack_weights(view[key]).tolist()
    return data


def render_html(data: dict, *, live: dict | None = None) -> str:
    """The explorer page for ``data`` (see :mod:`qkv.viz.export`).

    Args:
        data: a ``qkv-attention/1`` document (:func:`qkv.viz.export.explorer_data`).
        live: for ``qkv serve``: ``{"models": [names], "max_chars": int, "endpoint": url}``; the
            page then shows a text box that posts to ``endpoint``.

    Returns:
        The HTML text.
    """
    check_data(data)
    if live is not None:
        data = dict(data, live=live)
    data = packed_for_page(data)
    css, body = static_text("explorer.css"), static_text("explorer.html")
    scripts = [(name, static_text(name)) for name in SCRIPTS]
    for name, text, closing in [("explorer.css", css, "</style")] + [(n, t, "</script") for n, t in scripts]:
        if closing in text.lower():
            raise ValueError(f"{name} contains {closing!r}, which would end its inline element")
    js = "".join(text if text.endswith("\n") else text + "\n" for _, text in scripts)
    title = html.escape(data.get("title", "qkv attention explorer"))
    script = f"\n{js}"
    script_hash = "sha256-" + base64.b64encode(hashlib.sha256(script.encode("utf-8")).digest()).decode("ascii")
    csp = (_CSP_LIVE if live is not None else _CSP_STATIC).format(script_hash=script_hash)
    return (
        "<!DOCTYPE html>\n"
        '<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f'<meta http-equiv="Content-Security-Policy" content="{csp}">\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        f"<title>{title}</title>\n<style>\n{css}</style>\n</head>\n<body>\n{body}"
        f"{_DATA_OPEN}{json_for_script(data)}</script>\n"
        f"<script>{script}</script>\n</body>\n</html>\n"
    )


def write_html(data: dict, path: str | Path) -> Path:
    """Write the self-contained explorer page for ``data`` to ``path`` (atomically, see :mod:`qkv.runtime.fileio`)."""
    return write_text(path, render_html(data))
