"""The largest sizes qkv accepts for a model, declared once: the model configs check them (so the
Python API, recipes, run folders and the command line are bounded alike) and the tokenizer trainer
bounds its vocabulary with them. Each is far above what is in use, yet refuses a typo's size before
any memory is asked for."""

from __future__ import annotations

#: vocabulary sizes: the largest vocabularies in use hold about 256k tokens; 2**21 is 8x that
MAX_VOCAB_SIZE = 2**21
#: layers of a stack: the deepest Transformers trained hold about 1,000 (DeepNet)
MAX_LAYERS = 1024
#: d_model (and so heads, which divide it): the widest published models are about 20k wide
MAX_WIDTH = 2**16
#: d_ff: four times MAX_WIDTH, the usual ratio of the feed-forward width to d_model
MAX_FF_WIDTH = 2**18
#: max_len / context, the positional table's length: a million tokens, beyond any context trained
MAX_LENGTH = 2**20
