"""Model FLOPs counted from a configuration: the matrix products a forward (and a training step) does.

A product of an ``(m, k)`` and a ``(k, n)`` matrix is ``2 m n k`` FLOPs (a multiply and an add each).
Counted, per layer and per sequence of ``s`` real (non-padding) tokens, ``d`` = d_model:

* attention projections Q, K, V, O: ``4 x 2 s d^2`` (cross-attention: Q and O over the ``t`` target
  tokens, K and V over the ``s`` source tokens);
* attention scores ``Q K^T`` and weighted sum ``A V``: ``2 x 2 s_q s_k d``, over the *whole*
  ``s_q x s_k`` square even where a causal mask hides half of it: that is what qkv's kernels are asked
  to compute (the plain products always form the full square; PyTorch's SDPA is called on it too), and
  the convention of PaLM's MFU (Chowdhery et al. 2022, appendix B) and nanoGPT's ``estimate_mfu``;
* feed-forward network: ``2 x 2 s d d_ff``;
* output projection to the vocabulary: ``2 t d V`` over the predicted tokens.

Embedding look-ups, layer norms, softmax, activations, biases and the loss are not products and are
left out (they are a few percent at most), as in :class:`torch.utils.flop_counter.FlopCounterMode`,
which the tests compare these counts with.

A training step is forward + backward = 3 x forward: the backward of every product forms the
gradients of both operands (two products of the same size), and every product here has two
operands that need one (the first layer's input leads to the trainable embeddings). Recomputation
(activation checkpointing, or a fused attention kernel recomputing its scores in the backward, which
FlopCounterMode counts as 5 products instead of 4) is not model work and is not counted: MFU is model
FLOPs over peak FLOPs.

Every count is for sequences of the given real lengths, as if each ran alone without padding; the
share of padded positions a batch adds is reported beside it (:mod:`qkv.training.throughput`).
Heads do not change the count (``h`` heads of ``d / h`` features each).
"""

from __future__ import annotations

from collections.abc import Sequence

from qkv.models.causal_lm import CausalLMConfig
from qkv.models.transformer import TransformerConfig

TRAIN_FACTOR = 3  # forward + backward (gradients of both operands of every product)


def _lengths(lengths: Sequence[int], what: str) -> list[int]:
    out = [int(n) for n in lengths]
    if any(n < 0 for n in out):
        raise ValueError(f"{what} must be non-negative, got {min(out)}")
    return out


def self_attention_flops(d_model: int, length: int) -> int:
    """Forward FLOPs of one self-attention block over one sequence of ``length`` tokens."""
    s, d = length, d_model
    return 4 * 2 * s * d * d + 2 * 2 * s * s * d


def cross_attention_flops(d_model: int, tgt_length: int, src_length: int) -> int:
    """Forward FLOPs of one cross-attention block: ``tgt_length`` queries over ``src_length`` keys."""
    t, s, d = tgt_length, src_length, d_model
    return 2 * 2 * t * d * d + 2 * 2 * s * d * d + 2 * 2 * t * s * d


def feed_forward_flops(d_model: int, d_ff: int, length: int) -> int:
    """Forward FLOPs of one feed-forward network over ``length`` tokens."""
    return 2 * 2 * length * d_model * d_ff


def encoder_forward_flops(
    d_model: int, d_ff: int, num_layers: int, lengths: Sequence[int], *, pooled: bool = False
) -> int:
    """Forward FLOPs of an encoder stack (:class:`qkv.models.transformer.EncoderModel`, BERT's layers)
    over sequences of ``lengths`` real tokens. ``pooled``: add a ``d x d`` pooler over each
    sequence's first token (BERT's ``[CLS]`` pooler)."""
    total = 0
    for s in _lengths(lengths, "lengths"):
        total += num_layers * (self_attention_flops(d_model, s) + feed_forward_flops(d_model, d_ff, s))
        if pooled and s:
            total += 2 * d_model * d_model
    return total


def encoder_train_flops(
    d_model: int, d_ff: int, num_layers: int, lengths: Sequence[int], *, pooled: bool = False
) -> int:
    """Forward + backward FLOPs of :func:`encoder_forward_flops`."""
    return TRAIN_FACTOR * encoder_forward_flops(d_model, d_ff, num_layers, lengths, pooled=pooled)


def transformer_forward_flops(config: TransformerConfig, src_lengths: Sequence[int], tgt_lengths: Sequence[int]) -> int:
    """Forward FLOPs of the encoder-decoder :class:`~qkv.models.transformer.Transformer` with teacher
    forcing: sentence ``i`` has ``src_lengths[i]`` source tokens (EOS included) and ``tgt_lengths[i]``
    decoder positions (BOS + target; each predicts one token, projected to the vocabulary)."""
    src, tgt = _lengths(src_lengths, "source lengths"), _lengths(tgt_lengths, "target lengths")
    if len(src) != len(tgt):
        raise ValueError(f"{len(src)} source lengths but {len(tgt)} target lengths")
    c, d = config, config.d_model
    total = encoder_forward_flops(d, c.d_ff, c.num_encoder_layers, src)
    for s, t in zip(src, tgt):
        layer = self_attention_flops(d, t) + cross_attention_flops(d, t, s) + feed_forward_flops(d, c.d_ff, t)
        total += c.num_decoder_layers * layer + 2 * t * d * c.tgt_vocab_size
    return total


def transformer_train_flops(config: TransformerConfig, src_lengths: Sequence[int], tgt_lengths: Sequence[int]) -> int:
    """FLOPs of one training pass (forward + backward) over the sentence pairs (arguments as
    :func:`transformer_forward_flops`)."""
    return TRAIN_FACTOR * transformer_forward_flops(config, src_lengths, tgt_lengths)


def causal_lm_forward_flops(config: CausalLMConfig, lengths: Sequence[int]) -> int:
    """Forward FLOPs of a :class:`~qkv.models.causal_lm.CausalLM` over sequences of ``lengths`` tokens,
    every position projected to the vocabulary (the full causal square counted, see the module notes)."""
    c = config
    seqs = _lengths(lengths, "lengths")
    layers = encoder_forward_flops(c.d_model, c.d_ff, c.num_layers, seqs)
    return layers + sum(2 * s * c.d_model * c.vocab_size for s in seqs)


def causal_lm_train_flops(config: CausalLMConfig, lengths: Sequence[int]) -> int:
    """FLOPs of one training pass (forward + backward) of a causal LM over sequences of ``lengths`` tokens."""
    return TRAIN_FACTOR * causal_lm_forward_flops(config, lengths)
