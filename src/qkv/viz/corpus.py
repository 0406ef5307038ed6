"""Head statistics averaged over many sentences (``qkv attend --corpus FILE``).

One sentence says little about what a head does; averaged over a corpus the statistics of
:mod:`qkv.viz.analysis` show the head's habit. Each sentence weighs the same; the labels are
given to the averaged statistics with the same thresholds as for one sentence.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from tqdm.auto import tqdm

from qkv.runtime.textinput import iter_raw_lines, open_input
from qkv.viz.analysis import delimiter_indices, entropy_ratio, head_labels, head_stats, rounded, stack_layers
from qkv.viz.export import AttentionView

if TYPE_CHECKING:  # the explorers import the tokenizers library
    from qkv.viz.explorers import Explorer


def read_corpus(path: str | Path, *, max_chars: int | None = None) -> list[tuple[int, str]]:
    """The non-blank lines of a UTF-8 text file, stripped, with their line numbers (from 1), read a
    line at a time (a FIFO or ``/dev/fd/N`` too; see :mod:`qkv.runtime.textinput`).

    Raises:
        FileNotFoundError / IsADirectoryError / PermissionError: no such file, a folder, not
        readable. ValueError: not UTF-8, no sentence, or a line longer than ``max_chars`` (or than
        :data:`~qkv.runtime.textinput.MAX_LINE_BYTES`).
    """
    path = Path(path)
    try:
        handle = open_input(path, "corpus file")
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: corpus file not found") from None
    except IsADirectoryError:
        raise IsADirectoryError(f"{path}: is a folder; --corpus takes a text file, one sentence a line") from None
    lines = []
    with handle:
        for n, raw in iter_raw_lines(handle, str(path)):
            try:
                line = raw.decode("utf-8").strip()
            except UnicodeDecodeError as err:
                raise ValueError(f"{path} line {n}: not UTF-8 text ({err.reason} at byte {err.start})") from None
            if not line:
                continue
            if max_chars is not None and len(line) > max_chars:
                raise ValueError(f"{path} line {n}: {len(line)} characters; the limit is {max_chars}")
            lines.append((n, line))
    if not lines:
        raise ValueError(f"{path}: no sentences (the file is empty or blank)")
    return lines


class CorpusAverage:
    """Running sums of the head statistics of each view name, one sentence at a time."""

    def __init__(self) -> None:
        self.sentences = 0
        self._sums: dict[str, dict[str, torch.Tensor]] = {}
        self._broadness: dict[str, torch.Tensor] = {}

    def add(self, views: Iterable[AttentionView]) -> None:
        """Add one sentence's views (the same view names and sizes every time)."""
        for view in views:
            att = stack_layers(view.attentions)
            stats = head_stats(att, delimiters=delimiter_indices(view.keys), cross=view.cross)
            broadness = entropy_ratio(att)
            if view.name not in self._sums:
                self._sums[view.name] = {name: torch.zeros_like(value) for name, value in stats.items()}
                self._broadness[view.name] = torch.zeros_like(broadness)
            sums = self._sums[view.name]
            if broadness.shape != self._broadness[view.name].shape or set(stats) != set(sums):
                raise ValueError(
                    f"view {view.name!r}: {tuple(broadness.shape)} (layers, heads) differs from "
                    f"the earlier sentences' {tuple(self._broadness[view.name].shape)}"
                )
            for name, value in stats.items():
                sums[name] += value
            self._broadness[view.name] += broadness
        self.sentences += 1

    def field(self, file: str) -> dict:
        """The document's ``corpus`` field (see :mod:`qkv.viz.export`)."""
        if not self.sentences:
            raise ValueError("no sentences were added")
        views = {}
        for name, sums in self._sums.items():
            means = {stat: value / self.sentences for stat, value in sums.items()}
            views[name] = {
                "stats": {stat: rounded(value) for stat, value in means.items()},
                "labels": head_labels(means, self._broadness[name] / self.sentences),
            }
        return {"file": file, "sentences": self.sentences, "views": views}


def corpus_field(
    explorer: Explorer, sentences: Sequence[tuple[int, str]], *, file: str, progress: bool = False
) -> dict:
    """Run ``explorer.views`` on every sentence and average the head statistics.

    Args:
        explorer: an explorer from :func:`qkv.viz.explorers.open_explorer`.
        sentences: ``(line number, text)`` pairs from :func:`read_corpus`.
        file: the name shown for the corpus.
        progress: a tqdm progress bar over the sentences.

    Raises:
        ValueError: a sentence the model cannot take, naming its line.
    """
    average = CorpusAverage()
    for line, text in tqdm(sentences, desc="corpus", unit="sentence", disable=not progress):
        try:
            views = explorer.views(text)
        except ValueError as err:
            raise ValueError(f"{file} line {line}: {str(err).splitlines()[0]}") from None
        average.add(views)
    return average.field(file)
