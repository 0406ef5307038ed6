"""One self-contained HTML page from every experiment's results.

Finds every ``results.json`` and ``*.png`` under a folder; each experiment gets a section with its
claims (held or not, as computed from its numbers), its printed summary, its figures inlined as
base64 ``data:`` URLs, and its full JSON folded away. The page loads nothing from anywhere: no
scripts, no fonts, no external images (a Content-Security-Policy forbids them), so it opens
offline and can be mailed as one file.
"""

from __future__ import annotations

import base64
import html
import json
import logging
from datetime import datetime, timezone
from pathlib import Path

from qkv.experiments import EXPERIMENTS
from qkv.experiments.common import SCHEMA, write_text

logger = logging.getLogger(__name__)

CSS = """
body { font-family: system-ui, -apple-system, Segoe UI, sans-serif; max-width: 1200px; margin: 2em auto;
       padding: 0 1em; color: #222; line-height: 1.45; }
h1 { border-bottom: 2px solid #ddd; padding-bottom: .3em; }
section { border-top: 1px solid #ddd; margin-top: 2em; padding-top: .5em; }
.meta { color: #666; font-size: .9em; }
.claims { list-style: none; padding-left: 0; }
.held::before { content: "\\2713  "; color: #1a7f37; font-weight: bold; }
.failed::before { content: "\\2717  "; color: #cf222e; font-weight: bold; }
pre { background: #f6f8fa; padding: .8em; overflow-x: auto; font-size: .85em; }
img { max-width: 100%; border: 1px solid #eee; margin: .5em 0; }
nav a { margin-right: 1em; }
"""

CSP = "default-src 'none'; img-src data:; style-src 'unsafe-inline'"


def find_results(folder: str | Path) -> list[tuple[Path, dict]]:
    """Every ``results.json`` under ``folder`` with its parsed content, in the registry's order.

    Raises:
        FileNotFoundError: the folder does not exist or holds no results.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"no such folder {str(folder)!r}; run `qkv experiment NAME --out {folder}` first")
    found = []
    for path in sorted(folder.rglob("results.json")):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as err:
            logger.warning("skipping %s: %s", path, err)
            continue
        if not isinstance(data, dict):
            logger.warning("skipping %s: not a JSON object", path)
            continue
        found.append((path, data))
    order = list(EXPERIMENTS)
    found.sort(
        key=lambda item: (
            order.index(item[1].get("experiment", "")) if item[1].get("experiment") in order else len(order),
            str(item[0]),
        )
    )
    return found


def _image(path: Path) -> str:
    data = base64.b64encode(path.read_bytes()).decode("ascii")
    alt = html.escape(path.name)
    return f'<figure><img src="data:image/png;base64,{data}" alt="{alt}"><figcaption>{alt}</figcaption></figure>'


def _section(path: Path, data: dict, root: Path) -> tuple[str, str, set[Path]]:
    """HTML of one experiment; returns (anchor, html, the PNG paths it showed)."""
    name = str(data.get("experiment", path.parent.name))
    anchor = "exp-" + "".join(c if c.isalnum() else "-" for c in name)
    claim = EXPERIMENTS.get(name, ("", ""))[1]
    parts = [f'<section id="{html.escape(anchor)}"><h2>{html.escape(name)}</h2>']
    if claim:
        parts.append(f"<p><em>{html.escape(claim)}</em></p>")
    if data.get("schema") != SCHEMA:
        parts.append(f"<p class='meta'>note: schema {html.escape(str(data.get('schema')))!s}, expected {SCHEMA}</p>")
    env = data.get("environment", {}) if isinstance(data.get("environment"), dict) else {}
    meta = [
        f"folder {html.escape(str(path.parent.relative_to(root)) or '.')}",
        "quick mode" if data.get("quick") else "full mode",
        f"seed {html.escape(str(data.get('seed')))}",
        f"{float(data.get('seconds', 0.0)):.1f} s",
        f"torch {html.escape(str(env.get('torch', '?')))}",
        f"{html.escape(str(env.get('torch_threads', '?')))} thread{'' if env.get('torch_threads') == 1 else 's'}",
    ]
    if env.get("cuda_device") or env.get("cuda"):  # "cuda" named the device in results written before 2026-11-26
        meta.append(html.escape(str(env.get("cuda_device") or env["cuda"])))
    command = f"qkv experiment {name}" + (" --quick" if data.get("quick") else "") + f" --seed {data.get('seed')}"
    parts.append(f"<p class='meta'>{' &middot; '.join(meta)} &middot; <code>{html.escape(command)}</code></p>")
    claims = data.get("claims") or {}
    if claims:
        parts.append("<ul class='claims'>")
        for text, held in claims.items():
            parts.append(f"<li class='{'held' if held else 'failed'}'>{html.escape(str(text))}</li>")
        parts.append("</ul>")
    summary = data.get("summary") or []
    if summary:
        parts.append("<pre>" + html.escape("\n".join(str(line) for line in summary)) + "</pre>")
    listed = [path.parent / f for f in data.get("figures", []) if isinstance(f, str)]
    others = sorted(p for p in path.parent.glob("*.png") if p not in listed)
    shown = set()
    for png in listed + others:
        if png.is_file() and png.resolve().is_relative_to(root.resolve()):
            parts.append(_image(png))
            shown.add(png.resolve())
    parts.append(
        "<details><summary>results.json</summary><pre>"
        + html.escape(json.dumps(data, indent=2))
        + "</pre></details></section>"
    )
    return anchor, "\n".join(parts), shown


def build_report(folder: str | Path, *, title: str = "qkv experiments") -> str:
    """The HTML page for every result and figure under ``folder``."""
    root = Path(folder)
    results = find_results(root)
    pngs = sorted(p.resolve() for p in root.rglob("*.png"))
    if not results and not pngs:
        raise FileNotFoundError(
            f"no results.json or PNG under {str(root)!r}; run `qkv experiment NAME --out {root}` first"
        )
    sections, nav, shown = [], [], set()
    for path, data in results:
        anchor, body, images = _section(path, data, root)
        sections.append(body)
        nav.append(f'<a href="#{html.escape(anchor)}">{html.escape(str(data.get("experiment", path.parent.name)))}</a>')
        shown |= images
    loose = [p for p in pngs if p not in shown]
    if loose:
        sections.append(
            "<section id='other'><h2>Other figures</h2>" + "\n".join(_image(p) for p in loose) + "</section>"
        )
        nav.append("<a href='#other'>other figures</a>")
    held = sum(bool(v) for _, d in results for v in (d.get("claims") or {}).values())
    total = sum(len(d.get("claims") or {}) for _, d in results)
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    head = (
        f"<h1>{html.escape(title)}</h1><p class='meta'>{len(results)} experiments, {held} of {total} claims held "
        f"by the numbers &middot; built {stamp} from {html.escape(str(root))}</p><nav>{''.join(nav)}</nav>"
    )
    return (
        "<!DOCTYPE html>\n<html lang='en'>\n<head>\n<meta charset='utf-8'>\n"
        f"<meta http-equiv='Content-Security-Policy' content=\"{CSP}\">\n"
        "<meta name='viewport' content='width=device-width, initial-scale=1'>\n"
        f"<title>{html.escape(title)}</title>\n<style>{CSS}</style>\n</head>\n<body>\n{head}\n"
        + "\n".join(sections)
        + "\n</body>\n</html>\n"
    )


def write_report(folder: str | Path, output: str | Path | None = None, *, title: str = "qkv experiments") -> Path:
    """Write the page (atomically) to ``output``, by default ``<folder>/report.html``."""
    output = Path(output) if output is not None else Path(folder) / "report.html"
    return write_text(output, build_report(folder, title=title))
