"""The attention explorer inside a notebook (Jupyter classic and Lab, VS Code).

>>> from qkv.viz import show, head_view, model_view
>>> show(None, "time flies like an arrow")                     # all-MiniLM-L6-v2
>>> show("runs/en-de", "a dog runs on the beach")             # a qkv translation run
>>> show(explorer, ("time flies like an arrow", "fruit flies like a banana"))   # compared
>>> out = model(**inputs, output_attentions=True)              # a transformers model
>>> head_view(out.attentions, tokenizer.convert_ids_to_tokens(inputs["input_ids"][0]))

Each call returns an :class:`ExplorerView`; a notebook shows it inline through its
``_repr_html_``, and ``view.save("attention.html")`` writes the same file as ``qkv attend``.

How it works offline: the view's HTML is one ``<iframe>`` whose ``srcdoc`` attribute holds the
whole page :func:`qkv.viz.html.render_html` writes (markup, CSS, JavaScript and the packed
weights, all inline; its Content-Security-Policy allows no source but the page itself), so
nothing is fetched, from a CDN or from the notebook server, and the notebook file carries the
explorer with it. The frame is sandboxed (``allow-scripts allow-downloads``: scripts run, in an
opaque origin that cannot reach the notebook's page, cookies or kernel); each page has its own
document, so several explorers in one notebook never share element ids, styles or state. The
frame sits in a box the reader can resize (drag its lower edge); ``height`` sets where it starts.
A front end that forbids inline scripts for the notebook's own page (its Content-Security-Policy
is inherited by a ``srcdoc`` frame) shows the frame's markup without drawing.
"""

from __future__ import annotations

import html
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from qkv.runtime.fileio import check_output_file, write_text
from qkv.viz.explorers import EncoderExplorer, Explorer, Seq2SeqExplorer, open_explorer
from qkv.viz.export import check_data, explorer_data
from qkv.viz.html import render_html
from qkv.viz.lm_explorer import CausalLMExplorer
from qkv.viz.notebook_tensors import is_attention_tensors, tensor_document

PANELS = ("head-view", "model-view")  # the panel a page opens with on top (its "start" field)
MIN_HEIGHT, MAX_HEIGHT = 360, 1000  # the frame's starting height, in CSS pixels, is estimated within these


class ExplorerView:
    """An explorer page, shown inline by a notebook and savable as a file.

    Args:
        data: a ``qkv-attention/1`` document (:mod:`qkv.viz.export`).
        height: the frame's starting height in CSS pixels (default: estimated from the first view's
            tokens and layers, between 360 and 1000).

    Attributes:
        data: the document (checked by :func:`qkv.viz.export.check_data`).
        page: the HTML page, as :func:`qkv.viz.html.render_html` writes it.
        height: the frame's starting height.
    """

    def __init__(self, data: dict, *, height: int | None = None) -> None:
        check_data(data)
        if height is not None and (not isinstance(height, int) or isinstance(height, bool) or height < 100):
            raise ValueError(f"height must be a whole number of pixels, at least 100, got {height!r}")
        self.data = data
        self.page = render_html(data)
        self.height = height if height is not None else estimated_height(data)
        self.frame_id = f"qkv-explorer-{uuid.uuid4().hex}"  # unique on the notebook's page

    def _repr_html_(self) -> str:
        """The notebook's HTML: the page in a sandboxed ``<iframe srcdoc>`` inside a resizable box."""
        title = html.escape(self.data.get("title", "qkv attention explorer"))
        return (
            f'<div id="{self.frame_id}" class="qkv-explorer" style="resize: vertical; overflow: hidden; '
            f'height: {self.height}px; min-height: 120px; border: 1px solid #d9dee3; border-radius: 4px">'
            f'<iframe title="{title}" sandbox="allow-scripts allow-downloads" '
            f'style="width: 100%; height: 100%; border: 0; display: block" '
            f'srcdoc="{html.escape(self.page, quote=True)}"></iframe></div>'
        )

    def __repr__(self) -> str:
        examples = self.data["examples"]
        views = ", ".join(v["name"] for v in examples[0]["views"])
        return f"<ExplorerView {self.data.get('title', '')!r}: {len(examples)} example(s); {views}>"

    def save(self, path: str | Path, *, overwrite: bool = False) -> Path:
        """Write the self-contained page (the file ``qkv attend -o`` writes for the same document),
        atomically (:mod:`qkv.runtime.fileio`).

        Args:
            path: the HTML file to write.
            overwrite: replace ``path`` when it exists (refused otherwise).

        Returns:
            ``path``.

        Raises:
            FileExistsError: ``path`` exists and ``overwrite`` is false. IsADirectoryError: it is a folder.
        """
        path = Path(path)
        if not overwrite and (path.exists() or path.is_symlink()):
            raise FileExistsError(f"{path}: exists; pass overwrite=True to replace it")
        check_output_file(path, "path")
        return write_text(path, self.page)


def estimated_height(data: dict) -> int:
    """A starting height for the frame: the page's header and controls, the head view's rows for the
    first view's tokens and the model view's grid for its layers, within 360-1000 pixels."""
    view = data["examples"][0]["views"][0]
    rows = max(len(view["queries"]), len(view["keys"]))
    head_view = (15 if rows > 60 else 22) * rows + 60
    model_view = 68 * view["layers"] + 60
    return max(MIN_HEIGHT, min(MAX_HEIGHT, 200 + head_view + model_view))


def _explorer(model_or_run: object) -> Explorer:
    """The explorer for what :func:`show` was given: an open explorer, a model with its tokenizer,
    None (all-MiniLM-L6-v2) or a folder."""
    from qkv.models.causal_lm import CausalLM
    from qkv.models.transformer import Transformer
    from qkv.pretrained import BertEncoder

    if isinstance(model_or_run, (EncoderExplorer, Seq2SeqExplorer, CausalLMExplorer)):
        return model_or_run
    if isinstance(model_or_run, (BertEncoder, CausalLM, Transformer)):
        tokenizer = getattr(model_or_run, "tokenizer", None)
        if tokenizer is None:
            raise ValueError(
                f"this {type(model_or_run).__name__} has no tokenizer; pass its folder, or an explorer "
                "(qkv.viz.EncoderExplorer / Seq2SeqExplorer / CausalLMExplorer) made with one"
            )
        name = type(model_or_run).__name__
        if isinstance(model_or_run, BertEncoder):
            return EncoderExplorer(model=model_or_run, name=name)
        if isinstance(model_or_run, CausalLM):
            return CausalLMExplorer(model=model_or_run, tokenizer=tokenizer, name=name)
        return Seq2SeqExplorer(model=model_or_run, tokenizer=tokenizer, name=name)
    if model_or_run is None or isinstance(model_or_run, (str, Path)):
        if model_or_run is not None and not Path(model_or_run).exists():
            raise FileNotFoundError(f"{model_or_run}: no such run or model folder")
        return open_explorer(model_or_run)
    raise ValueError(
        f"model_or_run must be a qkv run folder, a pretrained model folder, None (all-MiniLM-L6-v2) or an "
        f"explorer from qkv.viz.open_explorer, got {type(model_or_run).__name__}"
    )


def _texts(text: object) -> list[str]:
    if isinstance(text, str):
        return [text]
    if isinstance(text, Sequence) and text and all(isinstance(t, str) for t in text):
        return list(text)
    raise ValueError(f"text must be a string or a list of strings (a pair to compare), got {type(text).__name__}")


def explorer_document(
    model_or_run: object,
    text: str | Sequence[str],
    *,
    target: str | Sequence[str] | None = None,
    compare: bool | None = None,
) -> dict[str, Any]:
    """The document ``qkv attend`` builds for these sentences (see :func:`show` for the arguments)."""
    from qkv.viz.compare import compare_field

    explorer = _explorer(model_or_run)
    texts = _texts(text)
    targets = [target] if isinstance(target, str) else list(target) if target is not None else []
    if targets and not isinstance(explorer, Seq2SeqExplorer):
        raise ValueError(f"target is for translation models; this model is {explorer.kind!r}")
    if targets and len(targets) != len(texts):
        raise ValueError(f"got {len(texts)} sentences but {len(targets)} targets")
    compare = len(texts) == 2 if compare is None else compare
    if compare and len(texts) != 2:
        raise ValueError(f"compare takes exactly two sentences, got {len(texts)}")
    examples = []
    for i, sentence in enumerate(texts):
        if targets and isinstance(explorer, Seq2SeqExplorer):
            examples.append(explorer.example(sentence, targets[i]))
        elif compare and isinstance(explorer, EncoderExplorer):  # the saliency of the pair's cosine similarity
            examples.append(explorer.example(sentence, paired_with=texts[1 - i]))
        else:
            examples.append(explorer.example(sentence))
    data = explorer_data(examples, title=f"qkv attention explorer: {explorer.name}")
    if compare:
        data["compare"] = compare_field(examples, 0, 1)
    return data


def show(
    model_or_run: object,
    text: str | Sequence[str],
    *,
    target: str | Sequence[str] | None = None,
    compare: bool | None = None,
    height: int | None = None,
) -> ExplorerView:
    """The explorer of a model on one sentence or several, to show in a notebook.

    Args:
        model_or_run: a qkv translation or language-model run folder, a pretrained folder that
            ``qkv attend --model`` takes (BERT family, GPT-2, Llama, Mistral, Qwen2, Marian), None
            for all-MiniLM-L6-v2, an explorer already open (:func:`qkv.viz.open_explorer`: reuse
            it to load the model once), or a model :func:`qkv.load_pretrained` returned (with its
            tokenizer).
        text: a sentence (a source sentence for a translation model), or a list of them; two are
            compared head by head (``qkv attend --compare``).
        target: translation models: the target to teacher-force (one per sentence).
        compare: compare two sentences (default: when exactly two are given).
        height: the frame's starting height in pixels (:class:`ExplorerView`).

    Returns:
        The :class:`ExplorerView`; ``.save(path)`` writes the page ``qkv attend -o`` would.

    Raises:
        FileNotFoundError: the folder is missing. ValueError: bad input (one line).
    """
    return ExplorerView(explorer_document(model_or_run, text, target=target, compare=compare), height=height)


def _start(data: dict[str, Any], panel: str, layer: int | None, heads: Sequence[int] | None) -> dict[str, Any]:
    """``data`` with its ``start`` field: the panel on top, and the layer and heads first shown."""
    view = data["examples"][0]["views"][0]
    start: dict[str, Any] = {"panel": panel}
    if layer is not None:
        if not isinstance(layer, int) or not 0 <= layer < view["layers"]:
            raise ValueError(f"layer must be below {view['layers']}, got {layer!r}")
        start["layer"] = layer
    if heads is not None:
        heads = list(heads)
        if not heads or not all(isinstance(h, int) and 0 <= h < view["heads"] for h in heads):
            raise ValueError(f"heads must be head indices below {view['heads']}, got {heads!r}")
        start["heads"] = heads
    return dict(data, start=start)


def _view_of(panel: str, given: dict[str, Any]) -> ExplorerView:
    """:func:`head_view` / :func:`model_view`: the document from tensors or from a model, opened on ``panel``."""
    attention, tokens = given.pop("attention"), given.pop("tokens")
    layer, heads, height = given.pop("layer"), given.pop("heads"), given.pop("height")
    model_or_run, text, target, compare = (given.pop(k) for k in ("model_or_run", "text", "target", "compare"))
    seq2seq = any(given[k] is not None for k in ("encoder_attention", "decoder_attention", "cross_attention"))
    if is_attention_tensors(attention) or seq2seq:
        if model_or_run is not None or text is not None or target is not None or compare is not None:
            raise ValueError("model_or_run, text, target and compare are for a model, not for attention tensors")
        data = tensor_document(attention, tokens, **given)
    else:
        extra = [k for k, v in given.items() if v is not None and k != "prettify_tokens"]
        if extra:
            raise ValueError(f"{', '.join(extra)}: only for attention tensors, not for a model and a text")
        if attention is not None and model_or_run is not None:
            raise ValueError("give the model once: as the first argument or as model_or_run=")
        model_or_run = attention if model_or_run is None else model_or_run
        text = tokens if text is None else text
        if text is None:
            raise ValueError("give attention tensors and their tokens, or a model (or run folder) and a text")
        data = explorer_document(model_or_run, text, target=target, compare=compare)
    return ExplorerView(_start(data, panel, layer, heads), height=height)


def head_view(
    attention: object = None,
    tokens: Any = None,
    *,
    sentence_b_start: int | None = None,
    prettify_tokens: bool = True,
    layer: int | None = None,
    heads: Sequence[int] | None = None,
    encoder_attention: object = None,
    decoder_attention: object = None,
    cross_attention: object = None,
    encoder_tokens: Sequence[str] | None = None,
    decoder_tokens: Sequence[str] | None = None,
    include_layers: Sequence[int] | None = None,
    model_or_run: object = None,
    text: str | Sequence[str] | None = None,
    target: str | Sequence[str] | None = None,
    compare: bool | None = None,
    height: int | None = None,
) -> ExplorerView:
    """The explorer opened on its head view (lines from each token to those it attends to).

    Two calling styles:

    * bertviz's: ``head_view(attention, tokens)``, ``attention`` one ``(1, heads, s, s)`` tensor per
      layer (what ``transformers`` returns with ``output_attentions=True``) and ``tokens`` its ``s``
      strings; or an encoder-decoder's ``encoder_attention``, ``decoder_attention`` and
      ``cross_attention`` with ``encoder_tokens`` and ``decoder_tokens``
      (:func:`qkv.viz.notebook_tensors.tensor_document` documents these and ``sentence_b_start``,
      ``prettify_tokens``, ``include_layers``);
    * qkv's: ``head_view(model_or_run, text)``, with :func:`show`'s ``target`` and ``compare``.

    Args:
        attention: the attention tensors; or a model folder, run folder or explorer (:func:`show`).
        tokens: the tokens; or the text.
        layer: the layer first shown (default 0).
        heads: the heads first switched on (default all).
        model_or_run, text: :func:`show`'s, spelled out (instead of the first two arguments).
        height: the frame's starting height in pixels.

    Returns:
        The :class:`ExplorerView`.

    Raises:
        ValueError: shapes that disagree with the tokens, a batch of several inputs, arguments of
            the two styles mixed (one line). FileNotFoundError: a missing folder.
    """
    return _view_of("head-view", dict(locals()))


def model_view(
    attention: object = None,
    tokens: Any = None,
    *,
    sentence_b_start: int | None = None,
    prettify_tokens: bool = True,
    layer: int | None = None,
    heads: Sequence[int] | None = None,
    encoder_attention: object = None,
    decoder_attention: object = None,
    cross_attention: object = None,
    encoder_tokens: Sequence[str] | None = None,
    decoder_tokens: Sequence[str] | None = None,
    include_layers: Sequence[int] | None = None,
    model_or_run: object = None,
    text: str | Sequence[str] | None = None,
    target: str | Sequence[str] | None = None,
    compare: bool | None = None,
    height: int | None = None,
) -> ExplorerView:
    """The explorer opened with its model view on top: every layer x head as a heatmap (a click
    opens that head in the head view, below it). The arguments are :func:`head_view`'s."""
    return _view_of("model-view", dict(locals()))
