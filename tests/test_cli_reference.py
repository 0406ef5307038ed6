"""The CLI reference (docs/reference/cli.md, filled at build time from qkv's parsers) names every option.

The parsers are walked here independently of :mod:`qkv.cli.reference`: each subcommand's parser is
built the way ``qkv COMMAND`` builds it (:func:`qkv.cli.build_parser` with that command chosen), and
every option string, positional argument and argument group must appear in that command's section
of the rendered reference. Then the page the documentation build serves is built with MkDocs (the
project's hook, on a one-page site) and must hold the same reference.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
from pathlib import Path

import pytest

from qkv.cli import COMMANDS, available_commands, build_parser
from qkv.cli.reference import MARKER, fill_page, render_markdown

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "reference" / "cli.md"
HOOK = ROOT / "docs_hooks" / "qkv_docs.py"


@pytest.fixture(scope="module")
def reference() -> str:
    return render_markdown()


def sections(reference: str) -> dict[str, str]:
    """``{command: its section}`` split at the ``## qkv COMMAND`` headings ("" for ``qkv`` itself)."""
    parts = re.split(r"^## qkv(?: (\S+))?\s*$", reference, flags=re.MULTILINE)
    return {name or "": body for name, body in zip(parts[1::2], parts[2::2])}


def command_parser(name: str) -> argparse.ArgumentParser:
    """The parser ``qkv NAME`` parses with (only the chosen command gets its arguments)."""
    parser = build_parser(name)
    (sub_action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return sub_action.choices[name]


def unescape(markdown: str) -> str:
    return re.sub(r"\\(.)", r"\1", markdown).replace("&lt;", "<").replace("&gt;", ">").replace("&amp;", "&")


def test_every_subcommand_has_a_section(reference):
    found = sections(reference)
    assert list(found) == ["", *available_commands()]
    for name, (_, help_text) in available_commands().items():
        assert help_text in unescape(found[name]), name
        assert f"usage: qkv {name}" in found[name]
    assert set(available_commands()) == set(COMMANDS)  # every registered module exists


@pytest.mark.parametrize("name", list(COMMANDS))
def test_every_option_of_every_subcommand_is_in_the_reference(reference, name):
    section = sections(reference)[name]
    parser = command_parser(name)
    group_starts = {}
    for group in parser._action_groups:
        visible = [a for a in group._group_actions if a.help is not argparse.SUPPRESS]
        if not visible:
            continue
        title = group.title or "options"
        heading = f"**{title[:1].upper() + title[1:]}**"
        assert heading in unescape(section), f"qkv {name}: group {title!r} missing"
        group_starts[title] = unescape(section).index(heading)
    ordered = sorted(group_starts.values()) + [len(section) + 1]
    for group in parser._action_groups:
        for action in group._group_actions:
            if action.help is argparse.SUPPRESS:
                continue
            start = group_starts[group.title or "options"]
            end = min(i for i in ordered if i > start)
            in_group = unescape(section)[start:end]
            names = action.option_strings or [action.metavar or action.dest]
            for option in names:
                assert re.search(rf"`{re.escape(str(option))}[` ]", in_group), (
                    f"qkv {name}: {option} is not listed under {group.title!r} in the CLI reference"
                )
            if action.help:
                first_words = " ".join(action.help.split()[:4])
                if "%(" not in first_words:
                    assert first_words in unescape(in_group), f"qkv {name} {names[0]}: help text missing"
            if (
                action.option_strings
                and isinstance(action.default, (int, float, str))
                and not isinstance(action.default, bool)
                and action.default not in ("", argparse.SUPPRESS)
                and "\n" not in str(action.default)
            ):
                assert f"default `{action.default}`" in in_group, f"qkv {name} {names[0]}: default missing"


def test_the_committed_page_holds_the_marker_and_the_build_fills_it(reference):
    page = PAGE.read_text(encoding="utf-8")
    assert page.count(MARKER) == 1
    assert fill_page(page, reference) == page.replace(MARKER, reference)
    with pytest.raises(ValueError, match="marker"):
        fill_page(page.replace(MARKER, ""), reference)


def test_the_built_site_serves_the_rendered_reference(tmp_path, reference):
    pytest.importorskip("mkdocs")
    yaml = pytest.importorskip("yaml")
    from mkdocs.commands.build import build
    from mkdocs.config import load_config

    # the project's configuration names this hook and serves this page
    config = yaml.load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"), Loader=yaml.BaseLoader)
    assert "docs_hooks/qkv_docs.py" in config["hooks"]
    assert "reference/cli.md" in (ROOT / "mkdocs.yml").read_text(encoding="utf-8")

    # the hook, run by MkDocs on a one-page site, serves the reference as rendered now
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "cli.md").write_text(PAGE.read_text(encoding="utf-8"), encoding="utf-8")
    hook = tmp_path / "hook.py"
    hook.write_text(
        HOOK.read_text(encoding="utf-8").replace('CLI_PAGE = "reference/cli.md"', 'CLI_PAGE = "cli.md"'),
        encoding="utf-8",
    )
    (tmp_path / "mkdocs.yml").write_text(
        f"site_name: t\ndocs_dir: docs\nsite_dir: site\nhooks: [{hook}]\nnav: [cli.md]\n"
        "markdown_extensions: [tables, toc]\n",
        encoding="utf-8",
    )
    build(load_config(config_file=str(tmp_path / "mkdocs.yml")))
    served = (tmp_path / "site" / "cli" / "index.html").read_text(encoding="utf-8")
    assert MARKER not in served
    for name in COMMANDS:
        assert f'id="qkv-{name}"' in served
        for action in command_parser(name)._actions:
            if action.help is argparse.SUPPRESS:  # hidden on purpose (e.g. serve's ignored 1.0 limits)
                continue
            for option in action.option_strings:
                assert f"<code>{option}" in served, f"qkv {name} {option} is not in the built page"


def test_the_hook_leaves_other_pages_alone():
    pytest.importorskip("mkdocs")
    spec = importlib.util.spec_from_file_location("qkv_docs_hook", HOOK)
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)

    class File:
        src_uri = "translation.md"

    class Page:
        file = File()

    assert hook.on_page_markdown(f"text {MARKER}", page=Page(), config=None, files=None) == f"text {MARKER}"
