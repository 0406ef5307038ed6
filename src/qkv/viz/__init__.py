"""Attention you can look at: export to JSON, a self-contained offline HTML explorer, PNG heatmaps,
and a local web app (``qkv serve``).

>>> explorer = open_explorer()                                  # all-MiniLM-L6-v2 by default
>>> data = explorer_data([explorer.example("time flies like an arrow")])
>>> write_html(data, "attention.html")                          # opens with no network

Any qkv model can be shown: build :class:`AttentionView` objects from its weights (one
``(h, s_q, s_k)`` tensor per layer) and pass them to :func:`make_example`. For a forward pass
that ran the fused kernel, :class:`AttentionRecorder` recomputes the chosen layers' weights exactly.
In a notebook, :func:`show`, :func:`head_view` and :func:`model_view` (:mod:`qkv.viz.notebook`)
display the explorer inline.
"""

from qkv.viz.capture import AttentionRecorder
from qkv.viz.explorers import EncoderExplorer, Seq2SeqExplorer, open_explorer, token_strings
from qkv.viz.export import AttentionView, check_data, explorer_data, make_example, write_json
from qkv.viz.html import render_html, write_html
from qkv.viz.lm_explorer import CausalLMExplorer
from qkv.viz.notebook import ExplorerView, head_view, model_view, show
from qkv.viz.png import save_heatmaps

__all__ = [
    "AttentionRecorder",
    "AttentionView",
    "CausalLMExplorer",
    "EncoderExplorer",
    "ExplorerView",
    "Seq2SeqExplorer",
    "check_data",
    "explorer_data",
    "head_view",
    "make_example",
    "model_view",
    "open_explorer",
    "render_html",
    "save_heatmaps",
    "show",
    "token_strings",
    "write_html",
    "write_json",
]
