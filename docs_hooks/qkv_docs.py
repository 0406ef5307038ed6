"""MkDocs hook of qkv's documentation site: the CLI reference is rendered from qkv's parsers at build time.

``docs/reference/cli.md`` is a short committed page holding the marker line
:data:`qkv.cli.reference.MARKER`; this hook replaces it with :func:`qkv.cli.reference.render_markdown`,
so the built site always shows the parsers of the code it was built from.
"""

from __future__ import annotations

import sys
from pathlib import Path

from mkdocs.exceptions import PluginError

CLI_PAGE = "reference/cli.md"


def on_config(config, **kwargs):
    # the parsers of the checkout being built, even where another qkv is installed
    src = str(Path(config.config_file_path).resolve().parent / "src")
    if src not in sys.path:
        sys.path.insert(0, src)
    return config


def on_page_markdown(markdown, page, config, files, **kwargs):
    if page.file.src_uri != CLI_PAGE:
        return markdown
    from qkv.cli.reference import fill_page

    try:
        return fill_page(markdown)
    except ValueError as err:
        raise PluginError(f"{CLI_PAGE}: {err}") from err
