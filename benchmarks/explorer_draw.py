"""How long the attention explorer takes to draw a 512-token input, in a real browser.

    python benchmarks/explorer_draw.py                    # all-MiniLM-L6-v2, two 512-token sentences
    python benchmarks/explorer_draw.py --tokens 128       # a shorter input
    python benchmarks/explorer_draw.py --synthetic        # a document of the same size without the model

The page is what ``qkv attend TEXT1 TEXT2 --compare`` writes for two sentences of ``--tokens``
wordpieces each (all-MiniLM-L6-v2, its tokenizer allowed 512 tokens instead of its 256: the model's
position table has 512), opened from disk in Debian's headless Chromium (Playwright, offline).
Two pages of the same document, one after the other: "packed" (as qkv attend writes it, the
weights packed by qkv.viz.html.pack_weights) and "plain" (the weights as JSON lists, as pages held
them before; skipped with ``--packed-only``). Measured inside the page with ``performance.now()``,
each ``--repeats`` times (medians reported):

* load: from navigation start, to the page's script starting (the HTML read), to its JSON parsed,
  to the weights unpacked, to the end of the first draw, and to the next animation frame after it
  (drawn on screen); the JavaScript heap then (Chromium's ``performance.memory``);
* each view: a click on its tab to the next animation frame (the view drawn); the page's own
  timer of the draw alone (``qkvExplorer.timings``);
* clicks: a model-view cell (the head view redrawn for that head), another layer, hovering a token
  (its lines and the shading), a saliency output, a compare entry;
* Save SVG and Save PNG of the head view (every head) and of the model view, once each.

Writes ``benchmarks/results/explorer/explorer_draw.json`` with the machine. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from qkv.bench.provenance import write_result
from qkv.bench.results import add_result_options, check_result_file

REPO = Path(__file__).resolve().parent.parent
CHROMIUM = "/usr/bin/chromium"
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
WORDS = [
    "time",
    "flies",
    "like",
    "an",
    "arrow",
    "fruit",
    "a",
    "banana",
    "the",
    "cat",
    "sat",
    "on",
    "mat",
    "dog",
    "runs",
    "beach",
    "she",
    "gave",
    "book",
    "to",
    "her",
    "brother",
    "because",
    "he",
    "asked",
    "for",
    "it",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "lazy",
    "attention",
    "is",
    "all",
    "you",
    "need",
]

# A click (or an event) dispatched in the page, then the time to the next animation frame.
CLICK_TO_FRAME = """async ([selector, kind]) => {
    const node = document.querySelector(selector);
    if (!node) { return null; }
    const t0 = performance.now();
    if (kind === "click") { node.click(); }
    else if (kind === "hover") { node.dispatchEvent(new MouseEvent("mouseover", {bubbles: true})); }
    else { node.value = kind; node.dispatchEvent(new Event("change", {bubbles: true})); }
    await new Promise(r => requestAnimationFrame(() => setTimeout(r, 0)));
    return performance.now() - t0;
}"""

SAVE = """([figure, format]) => { const t0 = performance.now(); window.qkvExplorer.save(figure, format);
    return performance.now() - t0; }"""

LOADED = """() => new Promise(r => requestAnimationFrame(() => setTimeout(() => {
    const t = window.qkvExplorer.timings;
    r([t.script, t.parsed, t.unpacked === undefined ? null : t.unpacked, t.first, performance.now(),
       performance.memory ? performance.memory.usedJSHeapSize : null]);
}, 0)))"""


def sentence(tokens: int, offset: int, tokenizer) -> str:
    """``tokens`` wordpieces with [CLS] and [SEP]: plain words that are one wordpiece each."""
    words = [WORDS[(i * 7 + offset) % len(WORDS)] for i in range(tokens - 2)]
    text = " ".join(words)
    if len(tokenizer([text]).tokens[0]) != tokens:
        raise SystemExit(f"the sentence is not {tokens} wordpieces long")
    return text


def make_document(args) -> tuple[dict, str]:
    """The document to draw, and how it was made."""
    if args.synthetic:
        sys.path.insert(0, str(REPO / "tests"))
        from explorer_documents import long_document

        data = long_document(tokens=args.tokens, layers=6, heads=12)
        return data, "tests/explorer_documents.long_document (6 layers x 12 heads)"
    import qkv
    from qkv.pretrained import default_model_path
    from qkv.pretrained.tokenizer import WordPieceTokenizer
    from qkv.viz import EncoderExplorer, explorer_data
    from qkv.viz.compare import compare_field

    model = qkv.load_pretrained(default_model_path(), device="cpu")
    # all-MiniLM-L6-v2's tokenizer stops at 256 tokens (sentence-transformers' setting); its position
    # table has 512, so the benchmark lets the tokenizer go to 512
    model.tokenizer = WordPieceTokenizer(model.tokenizer.backend, max_length=args.tokens)
    texts = [sentence(args.tokens, 0, model.tokenizer), sentence(args.tokens, 3, model.tokenizer)]
    explorer = EncoderExplorer(model=model, name="all-MiniLM-L6-v2")
    # what `qkv attend TEXT1 TEXT2 --compare` does (qkv.cli.attend), with the longer tokenizer
    examples = [explorer.example(texts[0], paired_with=texts[1]), explorer.example(texts[1], paired_with=texts[0])]
    data = explorer_data(examples, title="qkv attention explorer: all-MiniLM-L6-v2")
    data["compare"] = compare_field(examples, 0, 1)
    how = (
        f"EncoderExplorer(all-MiniLM-L6-v2, tokenizer max_length {args.tokens}).example(text, paired_with=other) "
        f"for two {args.tokens}-wordpiece sentences + compare_field, as qkv attend --compare"
    )
    return data, how


def write_pages(data: dict, folder: Path, *, plain: bool) -> dict[str, Path]:
    """The page as qkv attend writes it ("packed": the weights packed, qkv.viz.html.pack_weights) and,
    to measure the difference side by side, the same page with the weights as JSON lists ("plain":
    what the page held before they were packed; core.js still reads lists, as in qkv serve's answers)."""
    from unittest import mock

    from qkv.viz import html as page_html

    pages = {"packed": page_html.write_html(data, folder / "packed.html")}
    if plain:
        with mock.patch.object(page_html, "packed_for_page", lambda document: document):
            pages["plain"] = page_html.write_html(data, folder / "plain.html")
    return pages


def median(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return round(statistics.median(values), 1) if values else None


def measure(page_path: Path, repeats: int) -> dict:
    from playwright.sync_api import sync_playwright

    out: dict = {"load": {}, "views": {}, "clicks": {}, "saves": {}}
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        context = browser.new_context(viewport={"width": 1320, "height": 900})
        context.set_offline(True)
        script, parsed, unpacked, first, painted, wall, heap = [], [], [], [], [], [], []
        for _ in range(repeats):
            page = context.new_page()
            start = time.perf_counter()
            page.goto(page_path.as_uri())
            page.wait_for_function("() => Number(document.body.dataset.renders || 0) > 0", timeout=120_000)
            wall.append(1000 * (time.perf_counter() - start))
            started, data, ready, drawn, frame, used = page.evaluate(LOADED)
            script.append(started)
            parsed.append(data)
            unpacked.append(ready)
            first.append(drawn)
            painted.append(frame)
            heap.append(used)
            page.close()
        out["load"] = {
            "script_start_ms": median(script),
            "data_parsed_ms": median(parsed),
            "weights_unpacked_ms": median(unpacked),
            "first_draw_ms": median(first),
            "first_frame_ms": median(painted),
            "python_goto_to_drawn_ms": median(wall),
            "runs_first_draw_ms": [round(v, 1) for v in first],
            "js_heap_mb": round(statistics.median(heap) / 1e6, 1) if None not in heap else None,
        }
        page = context.new_page()
        page.goto(page_path.as_uri())
        page.wait_for_function("() => Number(document.body.dataset.renders || 0) > 0", timeout=120_000)
        out["tokens"] = page.locator("#head-svg text.query").count()
        out["head_view_lines"] = int(page.get_attribute("#head-svg", "data-lines"))
        out["head_view_mode"] = page.get_attribute("#head-svg", "data-mode")
        tabs = page.eval_on_selector_all("#tabs button:not([hidden])", "bs => bs.map(b => b.dataset.tab)")
        for tab in tabs:
            runs, own = [], []
            for _ in range(repeats):
                other = "summary" if tab == "attention" and "summary" in tabs else "attention"
                page.evaluate(CLICK_TO_FRAME, [f"#tabs button[data-tab='{other}']", "click"])
                runs.append(page.evaluate(CLICK_TO_FRAME, [f"#tabs button[data-tab='{tab}']", "click"]))
                own.append(page.evaluate(f"() => window.qkvExplorer.timings['{tab}']"))
            out["views"][tab] = {
                "click_to_frame_ms": median(runs),
                "draw_ms": median(own),
                "runs_click_to_frame_ms": [round(v, 1) for v in runs],
            }
        page.evaluate(CLICK_TO_FRAME, ["#tabs button[data-tab='attention']", "click"])
        clicks = {
            "model_view_cell": [
                ("#model-grid canvas[data-layer='3'][data-head='5']", "click"),
                ("#model-grid canvas[data-layer='1'][data-head='2']", "click"),
            ],
            "layer_select": [("#layer-select", "4"), ("#layer-select", "2")],
            "hover_token": [
                ("#head-svg text.query[data-index='3']", "hover"),
                ("#head-svg text.query[data-index='5']", "hover"),
            ],
            "all_heads_button": [("#heads-all", "click"), ("#heads-none", "click")],
        }
        if "saliency" in tabs:
            clicks["saliency_output"] = [
                ("#tabs button[data-tab='saliency']", "click"),
                ("#saliency-outputs .output-chip", "click"),
            ]
        if "compare" in tabs:
            clicks["compare_entry"] = [
                ("#tabs button[data-tab='compare']", "click"),
                ("#compare-heads .compare-head[data-index='1']", "click"),
                ("#compare-heads .compare-head[data-index='0']", "click"),
            ]
        for name, steps in clicks.items():
            runs = []
            for _ in range(repeats):
                for selector, kind in steps:
                    runs.append((selector, page.evaluate(CLICK_TO_FRAME, [selector, kind])))
            measured = [ms for selector, ms in runs if "tabs" not in selector]
            out["clicks"][name] = {"click_to_frame_ms": median(measured), "max_ms": round(max(measured), 1)}
            page.evaluate(CLICK_TO_FRAME, ["#tabs button[data-tab='attention']", "click"])
        # Save PNG / Save SVG of the head view with every head, and of the model view (once each)
        page.evaluate(CLICK_TO_FRAME, ["#heads-all", "click"])
        for figure in ("head-view", "model-view"):
            for fmt in ("svg", "png"):
                with page.expect_download(timeout=300_000):
                    ms = page.evaluate(SAVE, [figure, fmt])
                out["saves"][f"{figure}.{fmt}"] = {"ms": round(ms, 1)}
        context.close()
        browser.close()
    return out


def machine() -> dict:
    from qkv.bench.timing import environment

    info = environment()
    info["threads"] = os.cpu_count()
    info["chromium"] = subprocess.run([CHROMIUM, "--version"], capture_output=True, text=True).stdout.strip()
    return info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=512, help="wordpieces per sentence (default 512)")
    parser.add_argument("--repeats", type=int, default=5, help="measurements of each figure (default 5)")
    parser.add_argument("--synthetic", action="store_true", help="a document of the same size, without the model")
    parser.add_argument("--packed-only", action="store_true", help="skip the page with the weights as JSON lists")
    add_result_options(parser, REPO / "benchmarks" / "results" / "explorer" / "explorer_draw.json", flag="--output")
    args = parser.parse_args(argv)
    check_result_file(parser, args, flag="--output")  # before any work
    data, made_by = make_document(args)
    pages: dict = {}
    with tempfile.TemporaryDirectory() as folder:
        for name, page_path in write_pages(data, Path(folder), plain=not args.packed_only).items():
            size_mb = page_path.stat().st_size / 1e6
            load_before = [round(v, 2) for v in os.getloadavg()]
            pages[name] = {
                "page_mb": round(size_mb, 1),
                "load_average_before": load_before,
                **measure(page_path, args.repeats),
            }
            print(
                f"{name}: {pages[name]['tokens']} tokens, {size_mb:.1f} MB page, first draw "
                f"{pages[name]['load']['first_draw_ms']} ms",
                file=sys.stderr,
            )
    result = {
        "benchmark": "the attention explorer drawing a long input in headless Chromium (benchmarks/explorer_draw.py)",
        "command": "python benchmarks/explorer_draw.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "page": made_by,
        "pages": {
            "packed": "as qkv attend writes it: each view's attention and rollout packed (qkv.viz.html.pack_weights)",
            "plain": "the same document with the weights as JSON lists, as pages were before packing",
        },
        "repeats": args.repeats,
        **pages,
        "machine": machine(),
    }
    write_result(args.output, result)
    print(f"wrote {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
