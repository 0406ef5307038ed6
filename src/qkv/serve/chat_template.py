"""A model folder's chat template: how ``POST /v1/chat/completions`` turns a conversation into the
prompt the model continues.

The template is the folder's ``chat_template.jinja`` or the ``chat_template`` of its
``tokenizer_config.json`` (what transformers saves and reads), and it is rendered the way
transformers' ``apply_chat_template`` renders it: ``messages``, ``add_generation_prompt=True``, the
folder's ``bos_token`` and ``eos_token``, ``raise_exception(message)`` and ``strftime_now(format)``,
blocks trimmed, the loop controls on, ``tojson`` without HTML escaping. A template is code written
by someone else, so it runs in jinja2's immutable sandbox (no attribute starting with ``_``, no
changing the objects it is given, ranges bounded), never in a plain environment.

The sandbox keeps a template away from the server's objects, not from working forever or filling
memory, so a render is bounded too:

- time: a deadline (``max_seconds``) checked at every line the template's code runs;
- its text: at most ``max_chars`` characters written;
- what one step may build: a repeat (``'x' * n``), a ``+`` or ``%`` of texts or lists, a call's or a
  filter's result at most ``max_chars`` items; no number over ``max_chars`` handed to a call or a
  filter (``center(n)``, ``ljust(n)``, ``range(n)``); products and powers of integers at most
  :data:`MAX_INTEGER_BITS` bits.

What is left: a format string's width (``'{:>99999999}'.format``) and a ``~`` of texts are seen
only once their text is made (one step, bounded by the deadline after it). The server renders in a
worker thread, so a slow template holds up only its own request.
"""

from __future__ import annotations

import functools
import json
import sys
import time
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from types import FrameType
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"
MAX_TEMPLATE_CHARS = 1_000_000  # longer is not a chat template
MAX_RENDER_SECONDS = 2.0  # the templates of Llama, Mistral, Qwen2 render a conversation in well under 1 ms
MAX_PROMPT_CHARS = 1_000_000  # the longest text a render may write
MAX_INTEGER_BITS = 100_000  # the largest integer a product or a power may make


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

    def __init__(
        self,
        source: str,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        max_seconds: float = MAX_RENDER_SECONDS,
        max_chars: int = MAX_PROMPT_CHARS,
    ) -> None:
        self.source, self.bos_token, self.eos_token = source, bos_token, eos_token
        self.max_seconds, self.max_chars = max_seconds, max_chars
        environment = _BoundedSandbox(
            max_chars, trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        environment.filters["tojson"] = _tojson
        for name, function in environment.filters.items():
            environment.filters[name] = _bounded_filter(function, max_chars)
        environment.globals["raise_exception"] = _raise_exception
        environment.globals["strftime_now"] = _strftime_now
        try:
            self.template = environment.from_string(source)
        except jinja2.TemplateSyntaxError as err:
            raise ValueError(f"the chat template does not compile: {err.message} (line {err.lineno})") from None
        except _RenderLimit as err:  # an operation folded while compiling
            raise ValueError(f"the chat template does not compile: {err}") from None

    def render(self, messages: Sequence[Mapping[str, Any]]) -> str:
        """The prompt of a conversation, ending where the assistant's answer begins.

        Args:
            messages: the conversation, each message a mapping with ``role`` and ``content``.

        Returns:
            The rendered text (special tokens written as text, as the template writes them).

        Raises:
            ChatTemplateError: the template raised (``raise_exception``), failed, or went past its
                time, its text or a number's limit (one line).
        """
        specials = {
            name: value for name, value in (("bos_token", self.bos_token), ("eos_token", self.eos_token)) if value
        }
        context = {"messages": [dict(message) for message in messages], "add_generation_prompt": True, **specials}
        pieces: list[str] = []
        written = 0
        try:
            with _Deadline(self.max_seconds):
                for piece in self.template.generate(**context):
                    written += len(piece)
                    if written > self.max_chars:
                        raise _RenderLimit(f"it writes more than {self.max_chars} characters")
                    pieces.append(piece)
        except _RenderLimit as err:
            raise ChatTemplateError(f"the chat template was stopped: {err}") from None
        except jinja2.TemplateError as err:  # raise_exception, a security refusal, an undefined call...
            raise ChatTemplateError(" ".join(str(err).split()) or type(err).__name__) from None
        except (TypeError, ValueError, KeyError, IndexError, AttributeError, ZeroDivisionError, OverflowError) as err:
            raise ChatTemplateError(f"{type(err).__name__}: {' '.join(str(err).split())}") from None
        except RecursionError:
            raise ChatTemplateError("the chat template was stopped: it recurses too deeply") from None
        return "".join(pieces)


class _RenderLimit(Exception):
    """A render went past one of its limits (not a jinja2 error: the template cannot catch it)."""


class _Deadline:
    """Stop the template's code in this thread once ``seconds`` have passed: a trace function that
    looks at the clock on each line the template's compiled code runs (jinja2 compiles templates
    under the file name ``<template>``; no other code is traced). The thread's own trace function
    (a debugger's, coverage's) is put back after."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __enter__(self) -> None:
        self.deadline = time.monotonic() + self.seconds
        self.previous = sys.gettrace()
        sys.settrace(self._call)

    def __exit__(self, *exc: object) -> None:
        sys.settrace(self.previous)

    def _call(self, frame: FrameType, event: str, arg: object) -> Any:
        return self._line if frame.f_code.co_filename == "<template>" else None

    def _line(self, frame: FrameType, event: str, arg: object) -> Any:
        if event == "line" and time.monotonic() > self.deadline:
            raise _RenderLimit(f"it ran past {self.seconds:g} s")
        return self._line


def _check_numbers(values: Sequence[Any], limit: int) -> None:
    """Refuse an integer argument larger than ``limit`` (a width, a count of repeats)."""
    for value in values:
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > limit:
            raise _RenderLimit(f"the number {value if abs(value) < 10**30 else 'given'} is over its limit {limit}")


def _checked_size(result: Any, limit: int) -> Any:
    """``result``, refused when it is a text or list longer than ``limit`` (a format string's width)."""
    if isinstance(result, (str, list, tuple)) and len(result) > limit:
        raise _RenderLimit(f"an operation made {len(result)} items, over {limit}")
    return result


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """jinja2's immutable sandbox with products and powers bounded, no text or list made by ``+``,
    ``*``, ``%`` or a call longer than ``max_chars``, and no call given a number over ``max_chars``
    (``range`` is bounded by the sandbox itself)."""

    intercepted_binops = frozenset(["+", "*", "**", "%"])

    def __init__(self, max_chars: int, **options: Any) -> None:
        self.max_chars = max_chars
        super().__init__(**options)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        integers = isinstance(left, int) and isinstance(right, int)
        if operator == "**" and integers and abs(left) > 1 and right * left.bit_length() > MAX_INTEGER_BITS:
            raise _RenderLimit(f"the power {left} ** {right} is over {MAX_INTEGER_BITS} bits")
        if operator == "*" and integers and left.bit_length() + right.bit_length() > MAX_INTEGER_BITS:
            raise _RenderLimit(f"a product is over {MAX_INTEGER_BITS} bits")
        if operator == "*":
            for sized, count in ((left, right), (right, left)):
                repeats = isinstance(sized, (str, list, tuple)) and isinstance(count, int)
                if repeats and len(sized) * count > self.max_chars:
                    raise _RenderLimit(f"a repeat of {len(sized)} items {count} times is over {self.max_chars}")
        return _checked_size(super().call_binop(context, operator, left, right), self.max_chars)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 (jinja2's names)
        _check_numbers(args, __self.max_chars)
        _check_numbers(list(kwargs.values()), __self.max_chars)
        return _checked_size(super().call(__context, __obj, *args, **kwargs), __self.max_chars)


def _bounded_filter(function: Any, limit: int) -> Any:
    """``function`` (a filter) refusing a number over ``limit`` (``center(n)``, ``indent(n)``...)."""

    @functools.wraps(function)
    def bounded(*args: Any, **kwargs: Any) -> Any:
        _check_numbers(args, limit)
        _check_numbers(list(kwargs.values()), limit)
        return _checked_size(function(*args, **kwargs), limit)

    return bounded


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
