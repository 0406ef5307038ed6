"""A model folder's chat template: how ``POST /v1/chat/completions`` turns a conversation into the
prompt the model continues.

The template is the folder's ``chat_template.jinja`` or the ``chat_template`` of its
``tokenizer_config.json`` (what transformers saves and reads), and it is rendered the way
transformers' ``apply_chat_template`` renders it: ``messages``, ``add_generation_prompt=True``, the
folder's ``bos_token`` and ``eos_token``, ``raise_exception(message)`` and ``strftime_now(format)``,
blocks trimmed, the loop controls on, ``tojson`` without HTML escaping. A template is code written
by someone else, so it runs in jinja2's immutable sandbox (no attribute starting with ``_``, no
changing the objects it is given, ranges bounded), never in a plain environment.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"
MAX_TEMPLATE_CHARS = 1_000_000  # longer is not a chat template


class ChatTemplateError(ValueError):
    """The template refused the conversation (its ``raise_exception``) or failed while rendering it."""


class ChatTemplate:
    """A chat template, compiled in the sandbox, and the special tokens it may write.

    Args:
        source: the template's Jinja text.
        bos_token: the text of the folder's beginning-of-sequence token, or None.
        eos_token: the text of its end-of-sequence token, or None.

    Raises:
        ValueError: the template does not compile (one line, with its line number).
    """

    def __init__(self, source: str, *, bos_token: str | None = None, eos_token: str | None = None) -> None:
        self.source, self.bos_token, self.eos_token = source, bos_token, eos_token
        environment = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        environment.filters["tojson"] = _tojson
        environment.globals["raise_exception"] = _raise_exception
        environment.globals["strftime_now"] = _strftime_now
        try:
            self.template = environment.from_string(source)
        except jinja2.TemplateSyntaxError as err:
            raise ValueError(f"the chat template does not compile: {err.message} (line {err.lineno})") from None

    def render(self, messages: Sequence[Mapping[str, Any]]) -> str:
        """The prompt of a conversation, ending where the assistant's answer begins.

        Args:
            messages: the conversation, each message a mapping with ``role`` and ``content``.

        Returns:
            The rendered text (special tokens written as text, as the template writes them).

        Raises:
            ChatTemplateError: the template raised (``raise_exception``) or failed (one line).
        """
        specials = {
            name: value for name, value in (("bos_token", self.bos_token), ("eos_token", self.eos_token)) if value
        }
        try:
            return self.template.render(
                messages=[dict(message) for message in messages], add_generation_prompt=True, **specials
            )
        except jinja2.TemplateError as err:  # raise_exception, a security refusal, an undefined call...
            raise ChatTemplateError(" ".join(str(err).split()) or type(err).__name__) from None
        except (TypeError, ValueError, KeyError, IndexError, AttributeError, ZeroDivisionError, OverflowError) as err:
            raise ChatTemplateError(f"{type(err).__name__}: {' '.join(str(err).split())}") from None


def _raise_exception(message: object) -> None:
    """The template's ``raise_exception(message)``: refuse the conversation with that message."""
    raise jinja2.TemplateError(str(message))


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    """JSON as templates expect it: not HTML-escaped (jinja2's own ``tojson`` escapes ``<``, ``>``, ``&``)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    """Today's date and time in ``format`` (templates that write the date into a system message)."""
    return datetime.now().strftime(format)


def _token_text(value: Any) -> str | None:
    """A special token as ``tokenizer_config.json`` writes it: a string, or ``{"content": ...}``."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _read_json(path: Path) -> dict[str, Any]:
    """A JSON object from ``path``; ValueError naming the file otherwise."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: cannot be read as JSON ({' '.join(str(err).split())})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def _configured_template(value: Any, path: Path) -> str | None:
    """``chat_template`` of a tokenizer config: one template, or a list of named ones (``default`` is used)."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {entry.get("name"): entry.get("template") for entry in value if isinstance(entry, dict)}
        chosen = named.get("default")
        if isinstance(chosen, str):
            return chosen
        raise ValueError(f"{path}: chat_template is a list of named templates without a 'default' one")
    raise ValueError(f"{path}: chat_template must be a string or a list of named templates")


def load_chat_template(folder: str | Path | None) -> ChatTemplate | None:
    """The chat template of a model folder, or None when it has none.

    ``chat_template.jinja`` is read first (transformers 5 saves the template there); else the
    ``chat_template`` of ``tokenizer_config.json``. Its ``bos_token`` and ``eos_token`` come from
    ``tokenizer_config.json`` when it names them.

    Args:
        folder: the model's folder (None: no template).

    Returns:
        The compiled template, or None.

    Raises:
        ValueError: a file cannot be read, or the template does not compile (one line).
    """
    if folder is None:
        return None
    folder = Path(folder)
    config_path, template_path = folder / CONFIG_FILE, folder / TEMPLATE_FILE
    config = _read_json(config_path) if config_path.is_file() else {}
    if template_path.is_file():
        try:
            source: str | None = template_path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise ValueError(f"{template_path}: cannot be read ({' '.join(str(err).split())})") from None
    else:
        source = _configured_template(config.get("chat_template"), config_path)
    if source is None or not source.strip():
        return None
    if len(source) > MAX_TEMPLATE_CHARS:
        raise ValueError(f"the chat template of {folder} has {len(source)} characters; at most {MAX_TEMPLATE_CHARS}")
    return ChatTemplate(
        source, bos_token=_token_text(config.get("bos_token")), eos_token=_token_text(config.get("eos_token"))
    )
