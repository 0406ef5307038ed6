"""One self-contained HTML page: the explorer's markup, CSS, JavaScript and data, all inline.

Nothing is fetched from a network: the page's Content-Security-Policy forbids every source but
the page itself (and, in live mode, requests back to the local server that served it). The data
sits in a ``<script type="application/json">`` element that the JavaScript parses; it is never
pasted into code.
"""

from __future__ import annotations

import html
import json
from importlib import resources
from pathlib import Path

from qkv.fileio import write_text
from qkv.viz.export import check_data

# The page's JavaScript, inlined in this order into one <script> (core.js first: it makes the
# shared object the others add to; main.js last: it starts the page).
SCRIPTS = ("core.js", "figure.js", "lines.js", "attention.js", "summary.js", "rollout.js", "saliency.js",
           "compare.js", "export.js", "main.js")

_CSP_STATIC = "default-src 'none'; style-src 'unsafe-inline'; script-src 'unsafe-inline'; img-src data:"
_CSP_LIVE = _CSP_STATIC + "; connect-src 'self'"


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
    css, body = static_text("explorer.css"), static_text("explorer.html")
    scripts = [(name, static_text(name)) for name in SCRIPTS]
    for name, text, closing in [("explorer.css", css, "</style")] + [(n, t, "</script") for n, t in scripts]:
        if closing in text.lower():
            raise ValueError(f"{name} contains {closing!r}, which would end its inline element")
    js = "".join(text if text.endswith("\n") else text + "\n" for _, text in scripts)
    title = html.escape(data.get("title", "qkv attention explorer"))
    csp = _CSP_LIVE if live is not None else _CSP_STATIC
    return (
        "<!DOCTYPE html>\n"
        '<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f'<meta http-equiv="Content-Security-Policy" content="{csp}">\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        f"<title>{title}</title>\n<style>\n{css}</style>\n</head>\n<body>\n{body}"
        f'<script id="qkv-data" type="application/json">{json_for_script(data)}</script>\n'
        f"<script>\n{js}</script>\n</body>\n</html>\n"
    )


def write_html(data: dict, path: str | Path) -> Path:
    """Write the self-contained explorer page for ``data`` to ``path`` (atomically, see :mod:`qkv.fileio`)."""
    return write_text(path, render_html(data))
