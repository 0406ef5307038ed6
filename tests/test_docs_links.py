"""Links hold: every relative link and image in README.md and docs/ resolves, every results file named
exists, and nothing points outside the repository (issue 52).

Fast and independent of MkDocs: the Markdown is read with a few regular expressions. Fenced code is
skipped for links (a link there is text) but not for results paths (a command may name one).

- A link from README.md may point at any file or folder of the repository (GitHub serves them);
  a link from a docs/ page must stay inside docs/ (the site serves nothing else) and name a file.
- An ``#anchor`` into a Markdown file must be one of its headings: as MkDocs writes the id for a
  link from docs/, as GitHub does for a link from README.md. ``{#id}`` and ``<a id=...>`` count. The
  CLI reference's headings are generated (``qkv``, ``qkv-COMMAND``); the API page's anchors are
  the ``::: path`` objects and their members.
- ``benchmarks/results/...`` named anywhere (link, code span, code block, text) must exist, spelled
  out: no elided forms (``{,_seed1}``, ``..._wd01.json``).
- Nothing may point outside the repository: no link escaping its root, no absolute or ``file:``
  link, no ``../shared`` anywhere.
"""

from __future__ import annotations

import glob
import html
import re
import unicodedata
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def markdown_files(root: Path = ROOT) -> list[Path]:
    files = [root / "README.md"] if (root / "README.md").exists() else []
    return files + sorted((root / "docs").rglob("*.md"))


# ---------------------------------------------------------------------------------------------
# reading Markdown

FENCE = re.compile(r"^\s{0,3}(`{3,}|~{3,})")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
INLINE_TARGET = re.compile(r"\]\(\s*(<[^>]*>|[^)\s]+)(?:\s+(?:\"[^\"]*\"|'[^']*'|\([^)]*\)))?\s*\)")
REFERENCE_DEFINITION = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)")
HTML_TARGET = re.compile(r"""\b(?:src|href)\s*=\s*["']([^"']+)["']""", re.IGNORECASE)
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def lines_outside_fences(text: str):
    """(line number, line) for every line not inside a fenced code block (fence lines left out)."""
    fence = None
    for number, line in enumerate(text.splitlines(), start=1):
        match = FENCE.match(line)
        if fence is None and match:
            fence = match.group(1)
            continue
        if fence is not None:
            stripped = line.strip()
            if stripped.startswith(fence[0] * len(fence)) and not stripped.strip(fence[0]):
                fence = None
            continue
        yield number, line


def link_targets(text: str):
    """(line number, target) of every inline link or image, reference definition and HTML src/href."""
    for number, line in lines_outside_fences(text):
        plain = CODE_SPAN.sub(lambda m: " " * len(m.group(0)), line)  # code spans are not links
        for pattern in (INLINE_TARGET, REFERENCE_DEFINITION, HTML_TARGET):
            for match in pattern.finditer(plain):
                target = match.group(1)
                if target.startswith("<") and target.endswith(">"):
                    target = target[1:-1]
                yield number, target


# ---------------------------------------------------------------------------------------------
# heading ids, as MkDocs (Python-Markdown's toc) and GitHub write them


def _heading_text(raw: str) -> str:
    text = re.sub(r"!\[[^\]]*\]\([^)]*\)", "", raw)  # images add no text
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # links: their text
    text = re.sub(r"\[([^\]]*)\]\[[^\]]*\]", r"\1", text)
    text = CODE_SPAN.sub(lambda m: m.group(2).strip(), text)
    text = re.sub(r"<[^>]+>", "", text)
    text = re.sub(r"(\*\*|__|\*)(.+?)\1", r"\2", text)
    return html.unescape(text).strip()


def mkdocs_slug(text: str) -> str:
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def github_slug(text: str) -> str:
    text = text.strip().lower()
    text = "".join(ch for ch in text if ch.isalnum() or ch in " -_")
    return text.replace(" ", "-")


def headings(text: str) -> list[tuple[str, str | None]]:
    """(heading text, explicit ``{#id}`` or None) of every ATX and setext heading outside code."""
    found, previous = [], None
    for _, line in lines_outside_fences(text):
        atx = re.match(r"^\s{0,3}#{1,6}\s+(.*?)\s*#*\s*$", line)
        setext = re.match(r"^\s{0,3}(=+|-+)\s*$", line)
        raw = atx.group(1) if atx else (previous if setext and previous and previous.strip() else None)
        if raw is not None:
            explicit = re.search(r"\s*\{[^}]*#([\w-]+)[^}]*\}\s*$", raw)
            if explicit:
                raw = raw[: explicit.start()]
            found.append((_heading_text(raw), explicit.group(1) if explicit else None))
        previous = None if atx or setext else line
    return found


def anchors(path: Path, style: str) -> set[str]:
    """The ``#anchors`` a link may use into ``path`` (``style``: "mkdocs" or "github")."""
    text = path.read_text(encoding="utf-8")
    slug, separator = (mkdocs_slug, "_") if style == "mkdocs" else (github_slug, "-")
    ids: set[str] = set()
    seen: dict[str, int] = {}
    for heading, explicit in headings(text):
        if explicit:
            ids.add(explicit)
            continue
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        ids.add(base if count == 0 else f"{base}{separator}{count}")
    ids |= set(re.findall(r"""<a\s[^>]*(?:id|name)\s*=\s*["']([^"']+)["']""", text))
    ids |= set(re.findall(r"""\bid\s*=\s*["']([^"']+)["']""", text))
    if "<!-- qkv-cli-reference" in text:  # the CLI reference's generated headings
        from qkv.cli import COMMANDS

        ids |= {"qkv"} | {f"qkv-{name}" for name in COMMANDS}
    return ids


def api_objects(path: Path) -> list[str]:
    return re.findall(r"^:::\s*([\w.]+)", path.read_text(encoding="utf-8"), flags=re.MULTILINE)


# ---------------------------------------------------------------------------------------------
# the checks; each returns "file:line: problem" strings


def _where(path: Path, number: int, root: Path) -> str:
    return f"{path.relative_to(root)}:{number}"


def link_problems(root: Path = ROOT) -> list[str]:
    problems = []
    docs = root / "docs"
    for path in markdown_files(root):
        in_docs = docs in path.parents
        for number, target in link_targets(path.read_text(encoding="utf-8")):
            where = _where(path, number, root)
            if target.startswith("file:"):
                problems.append(f"{where}: {target!r} is a file: link (a path on one machine)")
                continue
            if SCHEME.match(target) or target.startswith("//"):
                continue  # http(s), mailto: outside this check
            file_part, _, anchor = target.partition("#")
            file_part = unquote(file_part)
            if file_part.startswith("/") or re.match(r"^[A-Za-z]:[\\/]", file_part):
                problems.append(f"{where}: {target!r} is an absolute path (write a path relative to {path.name})")
                continue
            resolved = (path.parent / file_part).resolve() if file_part else path
            try:
                resolved.relative_to(root)
            except ValueError:
                problems.append(f"{where}: {target!r} points outside the repository")
                continue
            if in_docs and docs not in resolved.parents:
                problems.append(
                    f"{where}: {target!r} leaves docs/, which the site cannot serve (name a "
                    "repository file as a code span, e.g. `benchmarks/README.md`)"
                )
                continue
            if not resolved.exists():
                problems.append(f"{where}: {target!r} does not exist ({resolved.relative_to(root)})")
                continue
            if in_docs and resolved.is_dir():
                problems.append(
                    f"{where}: {target!r} is a folder; link its page (e.g. {file_part.rstrip('/')}/index.md)"
                )
                continue
            if anchor and resolved.suffix == ".md":
                objects = api_objects(resolved)
                if any(anchor == o or anchor.startswith(o + ".") for o in objects):
                    continue
                if anchor not in anchors(resolved, "mkdocs" if in_docs else "github"):
                    problems.append(
                        f"{where}: {target!r}: {resolved.relative_to(root)} has no heading with the anchor #{anchor}"
                    )
    return problems


RESULTS_PATH = re.compile(r"benchmarks/results/[\w.\-/{}*?,\[\]]*")
ELIDED = re.compile(r"(?:\.\.\.|…)[\w\-]*\.(?:json|png|jsonl|txt|md)\b|\{[^}`]*,[^}`]*\}[\w\-]*\.(?:json|png)\b")


def results_problems(root: Path = ROOT) -> list[str]:
    problems = []
    for path in markdown_files(root):
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            where = _where(path, number, root)
            for match in RESULTS_PATH.finditer(line):
                named = match.group(0).rstrip(".,")
                if "{" in named or "," in named:
                    problems.append(f"{where}: {named!r} is an elided form; write each file name out")
                elif any(ch in named for ch in "*?["):
                    if not glob.glob(str(root / named)):
                        problems.append(f"{where}: {named!r} matches no file")
                elif not (root / named).exists():
                    problems.append(f"{where}: {named!r} does not exist")
            for span in CODE_SPAN.finditer(line):
                if ELIDED.search(span.group(2)) and not RESULTS_PATH.search(span.group(2)):
                    problems.append(f"{where}: `{span.group(2)}` is an elided file name; write it out in full")
    return problems


def outside_problems(root: Path = ROOT) -> list[str]:
    problems = []
    for path in markdown_files(root):
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            if "../shared" in line:
                problems.append(f"{_where(path, number, root)}: names '../shared', outside the repository")
    return problems


def _report(problems: list[str], what: str) -> str:
    return f"{len(problems)} {what}:\n" + "\n".join(problems)


# ---------------------------------------------------------------------------------------------
# the tests on the repository


def test_every_relative_link_and_image_resolves():
    problems = link_problems()
    assert not problems, _report(problems, "broken links (file:line)")


def test_every_results_path_named_exists():
    problems = results_problems()
    assert not problems, _report(problems, "results paths that do not exist (file:line)")


def test_nothing_points_outside_the_repository():
    problems = outside_problems() + [
        p for p in link_problems() if "outside the repository" in p or "absolute path" in p or "file: link" in p
    ]
    assert not problems, _report(problems, "references outside the repository (file:line)")


# ---------------------------------------------------------------------------------------------
# the checks themselves, on a scratch repository with deliberate breakage


@pytest.fixture
def scratch(tmp_path: Path) -> Path:
    (tmp_path / "docs" / "history").mkdir(parents=True)
    (tmp_path / "docs" / "figures").mkdir()
    (tmp_path / "docs" / "figures" / "a.png").write_bytes(b"")
    (tmp_path / "benchmarks" / "results" / "demo").mkdir(parents=True)
    (tmp_path / "benchmarks" / "results" / "demo" / "demo_time.json").write_text("{}")
    (tmp_path / "docs" / "translation.md").write_text(
        "# Translation\n\n## Train a model\n\n## Train a model\n\nSee `qkv train`.\n\n"
        "Evaluate: beam & length\n-----------------------\n\n## Own id {#custom}\n"
    )
    (tmp_path / "docs" / "api.md").write_text("# API\n\n::: qkv.Transformer\n")
    return tmp_path


def test_the_checks_pass_good_references(scratch: Path):
    (scratch / "README.md").write_text(
        "[docs](docs/translation.md#train-a-model) [folder](benchmarks/) [web](https://example.org/x)\n"
        "![fig](docs/figures/a.png) `benchmarks/results/demo/demo_time.json` [top](#readme)\n# Readme\n"
        "[evaluate](docs/translation.md#evaluate-beam--length)\n"
    )
    (scratch / "docs" / "index.md").write_text(
        "[t](translation.md#train-a-model_1) [e](translation.md#evaluate-beam-length) [c](translation.md#custom)\n"
        "![f](figures/a.png) [api](api.md#qkv.Transformer.encode) [h](history/log.md)\n"
        '<img src="figures/a.png"> [ref]: translation.md\n'
        "```\n[not a link](nowhere.md) ../shared is fine? no: see below\n```\n"
        "Results: `benchmarks/results/demo/demo_time.json`, benchmarks/results/demo/.\n"
    )
    (scratch / "docs" / "history" / "log.md").write_text("[back](../translation.md#translation)\n")
    assert link_problems(scratch) == []
    assert results_problems(scratch) == []
    # ../shared is refused even inside a code block
    assert outside_problems(scratch) == ["docs/index.md:5: names '../shared', outside the repository"]


def test_the_checks_find_every_broken_reference(scratch: Path):
    (scratch / "README.md").write_text(
        "line one\n[gone](docs/gone.md) ![img](docs/figures/b.png)\n[up](../elsewhere/README.md)\n"
        "[abs](/etc/passwd) [file](file:///tmp/x.md) [anchor](docs/translation.md#train-a-model_1)\n"
        "See [design](../shared/DESIGN.md).\n"
    )
    (scratch / "docs" / "index.md").write_text(
        "[out of docs](../README.md) [folder](history/)\n"
        "[missing anchor](translation.md#no-such-heading) [api](api.md#qkv.Nothing)\n"
        "[ref]: translation.md#nope\n"
        "`benchmarks/results/missing.json` and `benchmarks/results/demo/demo_time{,_seed1}.json`\n"
        "and `..._wd01.json` and benchmarks/results/demo/*.txt\n"
    )
    links = link_problems(scratch)
    expected_links = [
        "README.md:2: 'docs/gone.md' does not exist",
        "README.md:2: 'docs/figures/b.png' does not exist",
        "README.md:3: '../elsewhere/README.md' points outside the repository",
        "README.md:4: '/etc/passwd' is an absolute path",
        "README.md:4: 'file:///tmp/x.md' is a file: link",
        "README.md:4: 'docs/translation.md#train-a-model_1'",  # GitHub writes -1, not _1
        "README.md:5: '../shared/DESIGN.md' points outside the repository",
        "docs/index.md:1: '../README.md' leaves docs/",
        "docs/index.md:1: 'history/' is a folder",
        "docs/index.md:2: 'translation.md#no-such-heading'",
        "docs/index.md:2: 'api.md#qkv.Nothing'",
        "docs/index.md:3: 'translation.md#nope'",
    ]
    assert len(links) == len(expected_links), "\n".join(links)
    for found, start in zip(links, expected_links):
        assert found.startswith(start), (found, start)
    results = results_problems(scratch)
    assert results == [
        "docs/index.md:4: 'benchmarks/results/missing.json' does not exist",
        "docs/index.md:4: 'benchmarks/results/demo/demo_time{,_seed1}.json' is an elided form; write each file name out",
        "docs/index.md:5: 'benchmarks/results/demo/*.txt' matches no file",
        "docs/index.md:5: `..._wd01.json` is an elided file name; write it out in full",
    ], "\n".join(results)
    assert outside_problems(scratch) == ["README.md:5: names '../shared', outside the repository"]


def test_slugs_match_mkdocs_and_github():
    assert mkdocs_slug("Evaluate: beam & length") == "evaluate-beam-length"
    assert github_slug("Evaluate: beam & length") == "evaluate-beam--length"
    assert mkdocs_slug(_heading_text("`qkv train` on **Multi30k**")) == "qkv-train-on-multi30k"
    markdown = pytest.importorskip("markdown")
    page = "# Evaluate: beam & length\n\n## `qkv train` on [Multi30k](x.md)\n\n## Évite l'été 2.0\n"
    md = markdown.Markdown(extensions=["toc"])
    md.convert(page)
    ours = [mkdocs_slug(text) for text, _ in headings(page)]
    theirs = [token["id"] for token in _flatten(md.toc_tokens)]
    assert ours == theirs


def _flatten(tokens):
    for token in tokens:
        yield token
        yield from _flatten(token["children"])
