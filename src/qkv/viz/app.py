"""The attention explorer's request logic, independent of HTTP: :class:`ExplorerApp` validates a
request body, runs the chosen model and builds the page; a client's mistake is a :class:`RequestError`
(an HTTP status and a one-line message). :mod:`qkv.serve` puts it behind a web server.

Only models named at start-up can be used; inputs are capped at ``max_chars`` characters.
"""

from __future__ import annotations

import threading
from http import HTTPStatus

from qkv.inference.kinds import SEQ2SEQ
from qkv.viz.compare import compare_field
from qkv.viz.export import explorer_data
from qkv.viz.html import render_html

DEFAULT_MAX_CHARS = 500


class RequestError(Exception):
    """A client error: an HTTP status and a one-line message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class ExplorerApp:
    """The server's logic, independent of HTTP (so it can be tested directly).

    Args:
        explorers: name -> an explorer from :func:`qkv.viz.explorers.open_explorer` (the first is
            the default model). Only these can be used.
        max_chars: the longest accepted input, in characters.
        initial_text: the sentence drawn when the page opens.
    """

    def __init__(
        self, *, explorers: dict, max_chars: int = DEFAULT_MAX_CHARS, initial_text: str = "time flies like an arrow"
    ) -> None:
        if not explorers:
            raise ValueError("no models to serve")
        if max_chars <= 0:
            raise ValueError(f"max_chars must be positive, got {max_chars}")
        self.explorers = dict(explorers)
        self.max_chars = max_chars
        self.initial_text = initial_text[:max_chars]
        self._lock = threading.Lock()  # one forward pass at a time; the models are not re-entrant
        self._page: str | None = None

    @property
    def model_names(self) -> list[str]:
        """The names of the models the explorer serves."""
        return list(self.explorers)

    def attend(self, payload: object) -> dict:
        """Validate a request body and run the model; raise :class:`RequestError`.

        Body ``{"text": str, "model": name}`` (``"target"``: a translation to teacher-force) ->
        ``{"example": {...}}``. With ``"compare": str`` (a second sentence) ->
        ``{"example": first, "examples": [first, second], "compare": {...}}``, the compare field's
        ``"examples"`` being ``[0, 1]``, indices into this answer's ``"examples"`` (for a sentence
        encoder, each example's saliency is that of the pair's cosine similarity).
        """
        if not isinstance(payload, dict):
            raise RequestError(HTTPStatus.BAD_REQUEST, "the body must be a JSON object with 'text' (and 'model')")
        unknown = sorted(set(payload) - {"text", "model", "target", "compare"})
        if unknown:
            raise RequestError(
                HTTPStatus.BAD_REQUEST,
                f"unknown fields {unknown}; expected 'text' and 'model' (and 'target' or 'compare')",
            )
        text = self._text(payload, "text")
        name = payload.get("model", self.model_names[0])
        if not isinstance(name, str):
            raise RequestError(
                HTTPStatus.BAD_REQUEST,
                f"'model' must be a string, one of: {', '.join(self.model_names)} (got a {type(name).__name__})",
            )
        if name not in self.explorers:
            raise RequestError(
                HTTPStatus.BAD_REQUEST,
                f"unknown model {str(name)[:80]!r}; this server was started with: {', '.join(self.model_names)}",
            )
        explorer = self.explorers[name]
        target = payload.get("target")
        if target is not None and (
            explorer.kind != SEQ2SEQ.serve_kind or not isinstance(target, str) or len(target) > self.max_chars
        ):
            raise RequestError(HTTPStatus.BAD_REQUEST, "'target' must be a string, for a translation model only")
        if target is not None:
            _check_encodable("target", target)
        other = self._text(payload, "compare") if payload.get("compare") is not None else None
        if other is not None and target is not None:
            raise RequestError(HTTPStatus.BAD_REQUEST, "'target' and 'compare' cannot be used together")
        try:
            with self._lock:
                if other is None:
                    return {"example": explorer.example(text) if target is None else explorer.example(text, target)}
                if explorer.kind == "encoder":
                    examples = [explorer.example(text, paired_with=other), explorer.example(other, paired_with=text)]
                else:
                    examples = [explorer.example(text), explorer.example(other)]
            return {"example": examples[0], "examples": examples, "compare": compare_field(examples, 0, 1)}
        except ValueError as err:
            raise RequestError(HTTPStatus.BAD_REQUEST, str(err).splitlines()[0]) from err

    def _text(self, payload: dict, field: str) -> str:
        """A request's sentence: a non-empty string of at most ``max_chars`` characters."""
        text = payload.get(field)
        if not isinstance(text, str) or not text.strip():
            raise RequestError(HTTPStatus.BAD_REQUEST, f"'{field}' must be a non-empty string")
        if len(text) > self.max_chars:
            raise RequestError(
                HTTPStatus.BAD_REQUEST, f"'{field}' has {len(text)} characters; the limit is {self.max_chars}"
            )
        _check_encodable(field, text)
        return text

    def page(self) -> str:
        """The live explorer page with the initial sentence drawn by the default model."""
        if self._page is None:
            first = self.explorers[self.model_names[0]]
            with self._lock:
                example = first.example(self.initial_text)
            live = {"models": self.model_names, "max_chars": self.max_chars, "endpoint": "/api/attend"}
            self._page = render_html(explorer_data([example], title="qkv attention explorer"), live=live)
        return self._page


def _check_encodable(field: str, value: str) -> None:
    """JSON's ``\\ud800`` escapes decode to lone surrogates, which no UTF-8 text can hold."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:
        raise RequestError(
            HTTPStatus.BAD_REQUEST, f"'{field}' is not valid Unicode (a lone surrogate at character {err.start})"
        ) from None
