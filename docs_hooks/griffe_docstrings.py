"""Griffe extension for qkv's documentation site: qkv's docstrings made to render as Markdown.

Three things in them are not what mkdocstrings expects. Doctest lines (``>>> ...``) would become nested block quotes:
each run of them (with the output lines that follow, up to a blank line) becomes a ``pycon`` code
block. And Sphinx-style roles would show as text:

qkv's docstrings are Google style with reStructuredText cross-reference roles
(:class:`Transformer`, :func:`~qkv.decoding.search.beam_search`, :mod:`qkv.runs.translation`); each role is rewritten to an optional autorefs reference: a link to the
object where the API page documents it, its name in code font where it does not. The name is
resolved in the scope of the docstring's object (its module's imports and members), as Sphinx does;
a leading ``~`` shows only the last component. And a ``Returns:`` or ``Yields:`` section is prose
(the type is the signature's), but the Google parser takes whatever precedes the first colon of
its first line as a type: that colon is written as ``&#58;`` (shown as a colon) so it stays text.
"""

from __future__ import annotations

import html
import re

import griffe

ROLE = re.compile(r":(?:py:)?(?P<role>class|func|meth|mod|attr|data|obj|exc|const):`(?P<target>[^`]+)`")


def _resolve(obj: griffe.Object, name: str) -> str:
    """The full path of ``name`` as seen from ``obj``'s scope (``name`` itself when it cannot be resolved)."""
    if name.startswith("qkv.") or name == "qkv":
        return name
    head, _, rest = name.partition(".")
    scope = obj if obj.is_module or obj.is_class else obj.parent
    while scope is not None:
        try:
            path = scope.resolve(head)
        except (griffe.NameResolutionError, AttributeError, KeyError):
            scope = scope.parent
            continue
        return f"{path}.{rest}" if rest else path
    return name


def rewrite(text: str, obj: griffe.Object) -> str:
    def replace(match: re.Match) -> str:
        target = match["target"].strip()
        explicit = re.fullmatch(r"(?P<title>.+?)\s*<(?P<name>[^>]+)>", target)  # :class:`title <name>`
        if explicit:
            title, name = explicit["title"], explicit["name"]
        else:
            name = target.lstrip("~")
            title = name.rsplit(".", 1)[-1] if target.startswith("~") else name
        if match["role"] in ("func", "meth") and not title.endswith(")"):
            title += "()"
        identifier = html.escape(_resolve(obj, name.lstrip(".")), quote=True)
        return f'<autoref identifier="{identifier}" optional><code>{html.escape(title)}</code></autoref>'

    return ROLE.sub(replace, text)


def fence_doctests(text: str) -> str:
    """Runs of ``>>>`` lines (and their output, up to a blank line) as fenced ``pycon`` blocks."""
    out, block, indent = [], [], ""
    for line in text.split("\n") + [""]:
        stripped = line.lstrip()
        if stripped.startswith(">>>") or (block and stripped):
            if not block:
                indent = line[: len(line) - len(stripped)]
            block.append(line[len(indent) :] if line.startswith(indent) else stripped)
            continue
        if block:
            out += [f"{indent}```pycon", *(f"{indent}{b}" for b in block), f"{indent}```"]
            block = []
        out.append(line)
    return "\n".join(out[:-1])


RETURNS = re.compile(r"^(?P<indent>\s*)(?:Returns|Yields):\s*$")


def returns_as_prose(text: str) -> str:
    """The first line of each Returns/Yields section with its colons (outside code spans) as ``&#58;``."""
    lines = text.split("\n")
    for i, line in enumerate(lines[:-1]):
        if RETURNS.match(line) and ":" in lines[i + 1]:
            parts = re.split(r"(`+[^`]*`+)", lines[i + 1])  # code spans keep their colons
            lines[i + 1] = "".join(p if p.startswith("`") else p.replace(":", "&#58;") for p in parts)
    return "\n".join(lines)


class QkvDocstrings(griffe.Extension):
    def on_object(self, *, obj: griffe.Object, loader: griffe.GriffeLoader, **kwargs) -> None:
        if obj.docstring is None:
            return
        text = obj.docstring.value
        if ">>>" in text:
            text = fence_doctests(text)
        if ":" in text:
            text = returns_as_prose(rewrite(text, obj))
        obj.docstring.value = text
