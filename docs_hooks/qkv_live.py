"""MkDocs hook of qkv's documentation site: the live page's bundles (docs/live.md), made at build time.

The live page runs a qkv language model in the reader's browser with ONNX Runtime Web, and works from a
local folder (``file://``, where Chromium refuses ``fetch()``): so everything it needs comes in classic
``<script>`` files, the binary parts as base64. After the build this hook writes into the site's
``assets/live/``:

``ort-runtime.js``
    ONNX Runtime Web's script (``ort.wasm.min.js`` from ``web/node_modules/onnxruntime-web``, which
    ``npm ci --prefix web`` installs from ``web/package-lock.json``), its WebAssembly module gzipped and
    its loader module, both as base64 (the page gunzips the first with ``DecompressionStream`` and
    imports the second from a ``data:`` URL).
``model.js``
    ``web/live-model``: the graph ``python -m qkv.export.onnx_attention`` wrote (as base64) and its
    manifest.
``explain.js``
    the numbers of ``qkv explain``'s worked example (:func:`qkv.experiments.explain.worked_example`,
    its defaults), the by-hand part's starting inputs.

and on the page it replaces :data:`MARKER` with the ``<script>`` tags (and the stylesheet's), relative to the page.

Without ``web/node_modules`` (npm never run) the site still builds: ``ort-runtime.js`` then only tells
the page what is missing, which the page shows. ``QKV_DOCS_REQUIRE_WEB=1`` (CI sets it) makes that an
error instead.
"""

from __future__ import annotations

import base64
import gzip
import json
import logging
import os
import sys
from pathlib import Path

from mkdocs.exceptions import PluginError
from mkdocs.utils import get_relative_url

LIVE_PAGE = "live.md"
MARKER = "<!-- qkv-live-scripts -->"
ROOT = Path(__file__).resolve().parent.parent  # the checkout
WEB = ROOT / "web"
ORT_DIST = WEB / "node_modules" / "onnxruntime-web" / "dist"
MODEL_DIR = WEB / "live-model"
ASSETS = "assets/live"
SCRIPTS = ("ort-runtime.js", "model.js", "explain.js", "live.js")  # in load order; live.js is docs/assets/live's
STYLE = "live.css"  # docs/assets/live's
ORT_FILES = {"script": "ort.wasm.min.js", "loader": "ort-wasm-simd-threaded.mjs", "wasm": "ort-wasm-simd-threaded.wasm"}

log = logging.getLogger("mkdocs.hooks.qkv_live")


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _assign(name: str, value: object) -> str:
    """A line of JavaScript setting ``window[name]`` to ``value`` (JSON)."""
    return f"window.{name} = {json.dumps(value, separators=(',', ':'))};\n"


def ort_runtime_js(dist: Path = ORT_DIST) -> str:
    """The text of ``ort-runtime.js``: ONNX Runtime Web with its module and loader inlined, or, where
    ``dist`` is missing, a line telling the page so.

    Raises:
        PluginError: ``dist`` is missing and ``QKV_DOCS_REQUIRE_WEB=1``.
    """
    missing = [name for name in ORT_FILES.values() if not (dist / name).is_file()]
    if missing:
        why = f"ONNX Runtime Web is not installed ({dist} lacks {', '.join(missing)}): run `npm ci --prefix web`"
        if os.environ.get("QKV_DOCS_REQUIRE_WEB") == "1":
            raise PluginError(f"{LIVE_PAGE}: {why} (QKV_DOCS_REQUIRE_WEB=1)")
        log.info("%s: %s; the live page will say so", LIVE_PAGE, why)
        return _assign("QKV_ORT_MISSING", why + " and rebuild the site.")
    version = json.loads((dist.parent / "package.json").read_text(encoding="utf-8"))["version"]
    wasm = gzip.compress((dist / ORT_FILES["wasm"]).read_bytes(), compresslevel=6, mtime=0)
    return (
        f"/* ONNX Runtime Web {version} (MIT License, Microsoft), from the npm package onnxruntime-web */\n"
        + (dist / ORT_FILES["script"]).read_text(encoding="utf-8")
        + "\n"
        + _assign("QKV_ORT", {"version": version, "loader": _b64((dist / ORT_FILES["loader"]).read_bytes())})
        + _assign("QKV_ORT_WASM_GZ", _b64(wasm))
    )


def model_js(folder: Path = MODEL_DIR) -> str:
    """The text of ``model.js``: the live model's manifest and graph (base64).

    Raises:
        PluginError: the folder lacks its manifest or graph.
    """
    try:
        manifest = json.loads((folder / "manifest.json").read_text(encoding="utf-8"))
        graph = (folder / manifest["files"]["graph"]).read_bytes()
    except (OSError, KeyError, ValueError) as err:
        raise PluginError(f"{LIVE_PAGE}: cannot read the live model in {folder}: {err}") from err
    return _assign("QKV_LIVE_MODEL", {"manifest": manifest, "graph": _b64(graph)})


def explain_js() -> str:
    """The text of ``explain.js``: ``qkv explain``'s default example's inputs, weights and sizes."""
    src = str(ROOT / "src")
    if src not in sys.path:  # the checkout's qkv, even where another is installed
        sys.path.insert(0, src)
    from qkv.experiments.explain import worked_example

    example = worked_example()
    numbers = {name: getattr(example, name).tolist() for name in ("x", "w_q", "w_k", "w_v")}
    return _assign("QKV_EXPLAIN", {"seed": example.seed, "command": "qkv explain", **numbers})


def write_assets(site_dir: str | Path) -> list[Path]:
    """Write the generated bundles into ``site_dir``/assets/live; returns their paths."""
    out = Path(site_dir) / ASSETS
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in (("ort-runtime.js", ort_runtime_js()), ("model.js", model_js()), ("explain.js", explain_js())):
        path = out / name
        path.write_text(text, encoding="utf-8")
        written.append(path)
    return written


def on_page_markdown(markdown, page, config, files, **kwargs):
    if page.file.src_uri != LIVE_PAGE:
        return markdown
    if MARKER not in markdown:
        raise PluginError(f"{LIVE_PAGE}: the marker {MARKER!r} is missing")

    def url(name):
        return get_relative_url(f"{ASSETS}/{name}", page.url)

    tags = [f'<link rel="stylesheet" href="{url(STYLE)}">'] + [f'<script src="{url(n)}"></script>' for n in SCRIPTS]
    return markdown.replace(MARKER, "\n".join(tags))


def on_post_build(config, **kwargs):
    if (Path(config.docs_dir) / LIVE_PAGE).exists():
        write_assets(config.site_dir)
