"""The CLI reference as Markdown, rendered from qkv's own argparse parsers so it cannot drift.

:func:`full_parser` builds the ``qkv`` parser with every subcommand's options added (the CLI itself
adds only the chosen one's); :func:`render_markdown` turns it into one section per subcommand:
its description, usage and every option (flags, metavar, default, help) grouped as the parser
groups them. The documentation site's build (``docs_hooks/qkv_docs.py``) puts this text into
``docs/reference/cli.md``; ``python -m qkv.cli.reference`` prints it.
"""

from __future__ import annotations

import argparse
import re

#: the line in ``docs/reference/cli.md`` that the documentation build replaces with the reference
MARKER = "<!-- qkv-cli-reference: generated from the parsers at build time -->"

_USAGE_WIDTH = 78  # fixed, so the page does not depend on the terminal that built it (and fits its code box)


def full_parser() -> argparse.ArgumentParser:
    """The ``qkv`` parser with every available subcommand's options added."""
    from qkv.cli import build_parser

    return build_parser(None, every=True)


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """``{name: parser}`` of ``parser``'s subcommands, in the order they were registered."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _escape(text: str) -> str:
    """Plain help text as Markdown that shows the same characters (and no HTML)."""
    text = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return re.sub(r"([\\`*_\[\]|#])", r"\\\1", text)


def _code(text: str) -> str:
    """``text`` as one Markdown code span, whatever backticks it holds."""
    ticks = "`" * (max((len(run) for run in re.findall(r"`+", text)), default=0) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{ticks}{pad}{text}{pad}{ticks}"


def _formatter(parser: argparse.ArgumentParser) -> argparse.HelpFormatter:
    return argparse.HelpFormatter(prog=parser.prog, width=_USAGE_WIDTH, max_help_position=40)


def usage(parser: argparse.ArgumentParser) -> str:
    """The parser's usage line(s), wrapped at a fixed width."""
    formatter = _formatter(parser)
    formatter.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups)
    return formatter.format_help().strip()


def _help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    if not action.help:
        return ""
    expanded = _formatter(parser)._expand_help(action)  # fills %(default)s, %(choices)s, ...
    return " ".join(expanded.split())


def _default(action: argparse.Action) -> str | None:
    """The default worth showing: not for flags whose default is just "off", help or version."""
    if isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
        return None
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        return None
    default = action.default
    if default is None or default is argparse.SUPPRESS or default == [] or default == "":
        return None
    if isinstance(default, (list, tuple)):
        return " ".join(str(d) for d in default)
    if isinstance(default, str) and (default != default.strip() or not default.isprintable()):
        return repr(default)  # a newline or a space shown as Python writes it
    return str(default)


def _option_line(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    if action.option_strings:
        invocation = _formatter(parser)._format_action_invocation(action)
        parts = [", ".join(_code(part) for part in invocation.split(", "))]
    else:  # a positional by its name; its choices, if any, follow
        metavar = action.metavar if isinstance(action.metavar, str) else None
        parts = [_code(metavar or action.dest)]
    details = []
    if action.required and action.option_strings:
        details.append("required")
    if action.choices is not None and not isinstance(action, argparse._SubParsersAction):
        details.append("one of " + ", ".join(_code(str(c)) for c in action.choices))
    default = _default(action)
    if default is not None:
        details.append("default " + _code(default))
    if details:
        parts.append(f"({'; '.join(details)})")
    text = _help(parser, action)
    line = " ".join(parts)
    return f"- {line}" + (f": {_escape(text)}" if text else "")


def _groups(parser: argparse.ArgumentParser) -> list[tuple[str, str | None, list[argparse.Action]]]:
    """(title, description, actions) per argument group, as ``--help`` shows them (empty ones left out)."""
    out = []
    for group in parser._action_groups:
        actions = [
            a
            for a in group._group_actions
            if a.help is not argparse.SUPPRESS and not isinstance(a, argparse._SubParsersAction)
        ]
        if actions:
            out.append((group.title or "options", group.description, actions))
    return out


def render_command(name: str, parser: argparse.ArgumentParser) -> str:
    """One subcommand's section: heading, description, usage and its options by group."""
    lines = [f"## qkv {name}", ""]
    if parser.description:
        lines += [_escape(" ".join(parser.description.split())), ""]
    lines += ["```text", usage(parser), "```", ""]
    for title, description, actions in _groups(parser):
        lines += [f"**{_escape(title[:1].upper() + title[1:])}**", ""]
        if description:
            lines += [_escape(" ".join(description.split())), ""]
        lines += [_option_line(parser, action) for action in actions]
        lines.append("")
    if parser.epilog:
        lines += [_escape(" ".join(parser.epilog.split())), ""]
    return "\n".join(lines)


def render_markdown(parser: argparse.ArgumentParser | None = None) -> str:
    """The whole reference: ``qkv``'s own options, an index of the subcommands, then one section each."""
    parser = parser or full_parser()
    subs = subcommands(parser)
    from qkv.cli import COMMANDS

    lines = ["## qkv", ""]
    if parser.description:
        lines += [_escape(parser.description), ""]
    lines += ["```text", usage(parser), "```", ""]
    for title, _description, actions in _groups(parser):
        lines += [f"**{_escape(title[:1].upper() + title[1:])}**", ""]
        lines += [_option_line(parser, action) for action in actions]
        lines.append("")
    lines += ["| Command | What it does |", "| --- | --- |"]
    for name in subs:
        lines.append(f"| [`qkv {name}`](#qkv-{name}) | {_escape(COMMANDS[name][1])} |")
    lines.append("")
    for name, sub in subs.items():
        lines.append(render_command(name, sub))
    return "\n".join(lines).rstrip() + "\n"


def fill_page(markdown: str, reference: str | None = None) -> str:
    """The CLI reference page with its :data:`MARKER` line replaced by the rendered reference."""
    if MARKER not in markdown:
        raise ValueError(f"the CLI reference page has lost its marker line {MARKER!r}")
    return markdown.replace(MARKER, reference if reference is not None else render_markdown(), 1)


if __name__ == "__main__":
    print(render_markdown(), end="")
