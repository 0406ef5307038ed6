"""The decoder-only Transformer: a causal language model that predicts the next token.

Embeddings and positions, a stack of masked self-attention blocks (each query sees itself and
the tokens before it, through ``qkv.scaled_dot_product_attention(is_causal=True)``), a final
LayerNorm when pre-LN, and the output projection tied to the embedding. GPT-2's layout is the
default (pre-LN, learned positions, GELU, no embedding scaling), so GPT-2 checkpoints load into
it (:mod:`qkv.pretrained.gpt2`); ``norm_first=False, scale_embedding=True,
positional="sinusoidal"`` is the paper's decoder without cross-attention.

Shape legend: ``b`` batch, ``s`` sequence, ``d`` d_model, ``V`` vocabulary, ``h`` heads.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qkv.attention.multihead import KVCache
from qkv.models.options import check_fits_weights, check_model_options
from qkv.models.sampling import (  # re-exported: qkv generate and qkv serve import them from here
    MAX_TEMPERATURE,
    MIN_TEMPERATURE,
    MIN_TOP_P,
    check_sampling,
    sample_loop,
    sample_next,
)
from qkv.nn.feedforward import GATED
from qkv.nn.layers import EncoderLayer
from qkv.nn.loss import fused_linear_cross_entropy
from qkv.nn.norms import NORMS, build_norm
from qkv.nn.positional import POSITIONAL_KINDS, build_positional_encoding
from qkv.nn.rotary import ROTARY_SCALINGS, RotaryEmbedding
from qkv.runtime.fileio import write_json

IGNORE = -100  # a target id that adds nothing to the loss
LM_POSITIONAL_KINDS = (*POSITIONAL_KINDS, "rotary", "alibi")  # rotary and ALiBi: applied in the attention


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


__all__ = [
    "IGNORE",
    "MAX_TEMPERATURE",
    "MIN_TEMPERATURE",
    "MIN_TOP_P",
    "CausalDecoder",
    "CausalLM",
    "CausalLMConfig",
    "CausalLMOutput",
    "check_sampling",
    "sample_next",
]


@dataclass
class CausalLMConfig:
    """Sizes and options of a :class:`CausalLM`; every field means one thing. Defaults: GPT-2 small."""

    vocab_size: int = 50257  # tokens the model reads and predicts
    d_model: int = 768  # width
    num_heads: int = 12  # attention heads; d_model must be divisible by it
    num_layers: int = 12  # masked self-attention blocks
    d_ff: int = 3072  # inner width of the feed-forward network
    context: int = 1024  # longest sequence the model attends over (the positional table's size)
    dropout: float = 0.1  # residual and embedding dropout
    attention_dropout: float = 0.0  # dropout on attention weights
    activation: str = "gelu_tanh"  # feed-forward activation: gelu_tanh (GPT-2), gelu or relu (the paper)
    norm_first: bool = True  # pre-LN (GPT-2) or the paper's post-LN
    layer_norm_eps: float = 1e-5
    positional: str = "learned"  # learned (GPT-2), sinusoidal (the paper), rotary, alibi or none
    scale_embedding: bool = False  # multiply the token embedding by sqrt(d_model) (the paper, section 3.4)
    tie_output: bool = True  # the output projection is the token embedding (section 3.4)
    bias: bool = True  # biases in attention and feed-forward projections
    # The parts of today's models (Llama, Mistral, Qwen2); the defaults are GPT-2's.
    norm: str = "layer"  # layer (LayerNorm) or rms (RMSNorm); its epsilon is layer_norm_eps
    rotary_base: float = 10000.0  # positional="rotary": theta
    rotary_fraction: float = 1.0  # the first fraction of each head's dims rotated (partial rotary)
    rotary_scaling: str = "none"  # none, linear or llama3 (longer contexts from the same frequencies)
    rotary_scaling_factor: float = 1.0  # linear and llama3: how much longer
    rotary_low_freq_factor: float = 1.0  # llama3
    rotary_high_freq_factor: float = 4.0  # llama3
    rotary_original_context: int = 8192  # llama3: the context the frequencies were trained for
    num_kv_heads: int | None = None  # key/value heads: grouped-query (1: multi-query); None: num_heads
    sliding_window: int | None = None  # a query sees itself and the sliding_window - 1 tokens before it
    sliding_window_layers: list[int] | None = None  # the layers with the window; None: all (when sliding_window)
    qk_norm: bool = False  # a norm over each head's queries and keys
    qkv_bias: bool | None = None  # biases on the q/k/v projections; None: as bias
    logit_softcap: float | None = None  # logits = c * tanh(logits / c)

    # Fields added in qkv 2.0, whose defaults are the model every earlier run folder holds: a config.json
    # without them is an older run, not a damaged one (qkv.inference.runs.read_model_config).
    OPTIONAL_FIELDS: ClassVar[frozenset[str]] = frozenset(
        {
            "norm",
            "rotary_base",
            "rotary_fraction",
            "rotary_scaling",
            "rotary_scaling_factor",
            "rotary_low_freq_factor",
            "rotary_high_freq_factor",
            "rotary_original_context",
            "num_kv_heads",
            "sliding_window",
            "sliding_window_layers",
            "qk_norm",
            "qkv_bias",
            "logit_softcap",
        }
    )

    def __post_init__(self) -> None:
        check_model_options(
            self, ("vocab_size", "d_model", "num_heads", "num_layers", "d_ff", "context"), LM_POSITIONAL_KINDS
        )
        if self.norm not in NORMS:
            raise ValueError(f"norm must be one of {NORMS}, got {self.norm!r}")
        if self.num_kv_heads is not None and (
            not _is_int(self.num_kv_heads) or self.num_kv_heads <= 0 or self.num_heads % self.num_kv_heads
        ):
            raise ValueError(
                f"num_kv_heads must be a positive divisor of num_heads ({self.num_heads}), got {self.num_kv_heads!r}"
            )
        if self.sliding_window is not None and (not _is_int(self.sliding_window) or self.sliding_window < 1):
            raise ValueError(f"sliding_window must be a positive integer, got {self.sliding_window!r}")
        if self.sliding_window_layers is not None:
            layers = self.sliding_window_layers
            if not isinstance(layers, list) or not all(_is_int(i) and 0 <= i < self.num_layers for i in layers):
                raise ValueError(f"sliding_window_layers must list layers 0..{self.num_layers - 1}, got {layers!r}")
        if self.rotary_scaling not in ROTARY_SCALINGS:
            raise ValueError(f"rotary_scaling must be one of {ROTARY_SCALINGS}, got {self.rotary_scaling!r}")
        if not 0.0 < self.rotary_fraction <= 1.0:
            raise ValueError(f"rotary_fraction must be in (0, 1], got {self.rotary_fraction!r}")
        if not self.rotary_base > 1.0:
            raise ValueError(f"rotary_base must be above 1, got {self.rotary_base!r}")
        if self.qkv_bias is not None and not isinstance(self.qkv_bias, bool):
            raise ValueError(f"qkv_bias must be true, false or absent, got {self.qkv_bias!r}")
        if self.logit_softcap is not None and not (
            isinstance(self.logit_softcap, (int, float)) and self.logit_softcap > 0
        ):
            raise ValueError(f"logit_softcap must be a positive number, got {self.logit_softcap!r}")
        if self.positional == "rotary":
            self.rotary()  # its own checks (the rotated dims even, the scaling's values)

    @property
    def head_dim(self) -> int:
        """Each head's size: ``d_model // num_heads``."""
        return self.d_model // self.num_heads

    def rotary(self) -> RotaryEmbedding | None:
        """The rotary positions the layers share (``positional="rotary"``), or None."""
        if self.positional != "rotary":
            return None
        return RotaryEmbedding(
            self.head_dim,
            base=self.rotary_base,
            fraction=self.rotary_fraction,
            scaling=self.rotary_scaling,
            scaling_factor=self.rotary_scaling_factor,
            low_freq_factor=self.rotary_low_freq_factor,
            high_freq_factor=self.rotary_high_freq_factor,
            original_context=self.rotary_original_context,
        )

    def window(self, layer: int) -> int | None:
        """Layer ``layer``'s sliding window, or None (it sees every earlier token)."""
        if self.sliding_window is None or (
            self.sliding_window_layers is not None and layer not in self.sliding_window_layers
        ):
            return None
        return self.sliding_window

    def matrix_parameters(self) -> int:
        """The values of the model's weight matrices, embedding and positional table, counted from
        the sizes without building anything (biases and layer norms left out: a lower bound of its
        size, which :func:`~qkv.models.options.check_fits` compares with the memory).

        Returns:
            The count.
        """
        d = self.d_model
        table = self.context * d if self.positional in ("learned", "sinusoidal") else 0
        output = 0 if self.tie_output else self.vocab_size * d
        kv = (self.num_heads if self.num_kv_heads is None else self.num_kv_heads) * self.head_dim
        attention = 2 * d * d + 2 * d * kv
        feed_forward = (3 if self.activation in GATED else 2) * d * self.d_ff
        return self.vocab_size * d + output + table + self.num_layers * (attention + feed_forward)

    def layer_kwargs(self, layer: int = 0, rotary: RotaryEmbedding | None = None) -> dict:
        """The arguments block ``layer``'s :class:`~qkv.nn.layers.EncoderLayer` is built with
        (``rotary``: the rotary positions the blocks share)."""
        return dict(
            norm=self.norm,
            num_kv_heads=self.num_kv_heads,
            qkv_bias=self.qkv_bias,
            rotary=rotary,
            qk_norm=self.qk_norm,
            window=self.window(layer),
            alibi=self.positional == "alibi",
            d_model=self.d_model,
            num_heads=self.num_heads,
            d_ff=self.d_ff,
            dropout=self.dropout,
            attention_dropout=self.attention_dropout,
            activation=self.activation,
            norm_first=self.norm_first,
            layer_norm_eps=self.layer_norm_eps,
            bias=self.bias,
        )

    @classmethod
    def from_dict(cls, data: dict) -> CausalLMConfig:
        """The config saved as ``data`` (what :meth:`to_json` writes).

        Args:
            data: field names to values; missing fields take their defaults.

        Returns:
            The config.

        Raises:
            ValueError: a key is not a field (a typo, or a config of another model).
        """
        unknown = sorted(set(data) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"unknown CausalLMConfig fields: {unknown}")
        return cls(**data)

    def to_json(self, path: str | Path) -> None:
        """Write the config to ``path`` as JSON, atomically (:func:`qkv.runtime.fileio.write_json`)."""
        write_json(path, asdict(self))


@dataclass
class CausalLMOutput:
    """What :class:`CausalLM` returns: the next-token logits (None with ``project=False``), the final
    hidden states, the attention weights of every layer when asked for, and the per-layer KV cache
    to pass to the next step."""

    logits: Tensor | None  # (b, s, V); None with project=False
    hidden: Tensor  # (b, s, d) the final hidden states
    attentions: list[Tensor] | None = None  # per layer (b, h, s, s_k)
    cache: list[KVCache] | None = field(default=None, repr=False)  # per layer, for the next step


class CausalDecoder(nn.Module):
    """The stack: ``num_layers`` blocks of masked self-attention and feed-forward (each an
    :class:`~qkv.nn.layers.EncoderLayer` run with ``is_causal=True``), then a LayerNorm when pre-LN."""

    def __init__(self, config: CausalLMConfig) -> None:
        super().__init__()
        rotary = config.rotary()  # one table of frequencies, shared by the blocks
        self.layers = nn.ModuleList(EncoderLayer(**config.layer_kwargs(i, rotary)) for i in range(config.num_layers))
        self.norm = build_norm(config.norm, config.d_model, config.layer_norm_eps) if config.norm_first else None

    def forward(
        self, x: Tensor, *, cache: list[KVCache] | None = None, need_weights: bool = False
    ) -> tuple[Tensor, list[Tensor] | None, list[KVCache]]:
        """``x (b, s, d)``; ``cache`` from the previous call (its keys come before ``x``).
        Returns the hidden states, per-layer weights if asked, and the new cache."""
        attentions: list[Tensor] | None = [] if need_weights else None
        new_cache: list[KVCache] = []
        for i, layer in enumerate(self.layers):
            out = layer(x, is_causal=True, need_weights=need_weights, cache=None if cache is None else cache[i])
            x = out.output
            new_cache.append(out.self_cache)
            if attentions is not None:
                attentions.append(out.self_weights)
        if self.norm is not None:
            x = self.norm(x)
        return x, attentions, new_cache


class CausalLM(nn.Module):
    """Decoder-only Transformer language model.

    ``forward(ids)`` gives next-token logits at every position; :meth:`loss` is what training
    minimises (the fused loss: the ``(b, s, V)`` logits are never stored); :meth:`generate` samples
    continuations with a key/value cache.
    """

    def __init__(self, config: CausalLMConfig) -> None:
        super().__init__()
        check_fits_weights(config.matrix_parameters())
        self.config = config
        d = config.d_model
        self.token_embedding = nn.Embedding(config.vocab_size, d)
        table = config.positional if config.positional in POSITIONAL_KINDS else "none"  # rotary, alibi: in attention
        self.positional = build_positional_encoding(table, d, config.context)
        self.embed_scale = math.sqrt(d) if config.scale_embedding else 1.0
        self.dropout = nn.Dropout(config.dropout)
        self.decoder = CausalDecoder(config)
        self.output_proj = nn.Linear(d, config.vocab_size, bias=False)
        self._init_weights()
        if config.tie_output:
            self.output_proj.weight = self.token_embedding.weight

    def _init_weights(self) -> None:
        """N(0, 0.02) matrices and embeddings (N(0, d^-0.5) when scaled by sqrt(d)), zero biases;
        the projections that write into the residual stream scaled down by sqrt(2 * layers)
        (GPT-2), so the residual's variance does not grow with depth."""
        std = self.config.d_model**-0.5 if self.config.scale_embedding else 0.02
        residual_std = 0.02 / math.sqrt(2 * self.config.num_layers)
        for name, param in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(param)
            elif param.dim() < 2:  # LayerNorm weights
                continue
            elif name == "token_embedding.weight":
                nn.init.normal_(param, std=std)
            elif name.endswith(("out_proj.weight", "linear2.weight")):
                nn.init.normal_(param, std=residual_std)
            elif not name.startswith("positional."):
                nn.init.normal_(param, std=0.02)

    def forward(
        self, ids: Tensor, *, cache: list[KVCache] | None = None, need_weights: bool = False, project: bool = True
    ) -> CausalLMOutput:
        """Args:
        ids: ``(b, s)`` token ids (with a ``cache``: only the new ones).
        cache: the previous call's ``cache``; positions continue after it.
        need_weights: return each layer's attention weights ``(b, h, s, s_k)``.
        project: compute the logits (False: only ``hidden``, for :meth:`loss`).
        """
        if ids.dim() != 2 or ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"ids must be integers of shape (batch, seq), got {ids.dtype} {tuple(ids.shape)}")
        start = 0 if cache is None else cache[0].next_positions  # (b,) per row in a batch of joined members
        longest = (start if isinstance(start, int) else int(start.max())) + ids.size(1)
        if longest > self.config.context:
            raise ValueError(f"{longest} tokens exceed the model's context of {self.config.context}")
        x = self.dropout(self.positional(self.token_embedding(ids) * self.embed_scale, start))  # (b, s, d)
        hidden, attentions, new_cache = self.decoder(x, cache=cache, need_weights=need_weights)
        return CausalLMOutput(self.logits(hidden) if project else None, hidden, attentions, new_cache)

    def logits(self, hidden: Tensor) -> Tensor:
        """The next-token logits ``(..., V)`` of final hidden states ``(..., d)``: the output projection,
        soft-capped where the config says (``c * tanh(logits / c)``)."""
        logits = self.output_proj(hidden)
        cap = self.config.logit_softcap
        return logits if cap is None else cap * torch.tanh(logits / cap)

    @property
    def chunked_loss(self) -> bool:
        """Whether the loss projects the hidden states a chunk of rows at a time
        (:func:`qkv.nn.loss.fused_linear_cross_entropy`: the ``(b, s, V)`` logits are never stored): with
        a vocabulary larger than ``d_model``. With a smaller one (e.g. characters) the logits are no
        larger than the hidden states, and one plain product and ``F.cross_entropy`` are faster
        (measured: 3% of a step at V = 65)."""
        return self.config.vocab_size > self.config.d_model and self.config.logit_softcap is None

    def hidden_states(self, ids: Tensor) -> Tensor:
        """The final hidden states ``(b, s, d)`` for ``ids (b, s)``: what the output projection turns
        into logits, and what a training objective reads (:mod:`qkv.training.objectives`)."""
        return self(ids, project=False).hidden

    def loss(self, ids: Tensor, targets: Tensor, *, label_smoothing: float = 0.0) -> Tensor:
        """Summed cross-entropy of predicting ``targets (b, s)`` (usually ``ids`` shifted left by
        one; ``-100`` where nothing is predicted) from ``ids (b, s)``, label-smoothed by
        ``label_smoothing``: the fused loss or the logits' as :attr:`chunked_loss` says. Other training
        objectives are the training layer's (:mod:`qkv.training.objectives`)."""
        hidden = self.hidden_states(ids)
        if self.chunked_loss:
            return fused_linear_cross_entropy(hidden, self.output_proj.weight, targets, label_smoothing, IGNORE)
        logits = self.logits(hidden).float()  # (b, s, V)
        return F.cross_entropy(
            logits.reshape(-1, logits.size(-1)),
            targets.reshape(-1),
            ignore_index=IGNORE,
            label_smoothing=label_smoothing,
            reduction="sum",
        )

    def generate(
        self,
        ids: Tensor,
        max_new_tokens: int,
        *,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        generator: torch.Generator | None = None,
        use_cache: bool = True,
        on_step: Callable[[Tensor], bool | None] | None = None,
    ) -> Tensor:
        """Continue every row of ``ids (b, s)`` by up to ``max_new_tokens`` sampled tokens
        (:func:`qkv.models.sampling.sample_loop`, in eval mode; the mode is restored after).

        The model sees at most its last ``context`` tokens: a longer sequence is cropped from the
        left. With ``use_cache`` each step runs only the new token through the model, reusing the
        keys and values of the earlier ones, until the sequence fills the context; from there on
        every step re-reads the last ``context`` tokens (their positions moved), which is what
        ``use_cache=False`` does at every step, so both give the same tokens.

        Args:
            ids: ``(b, s)`` the prompts.
            max_new_tokens: the most tokens to add.
            temperature: divides the logits; 0 picks the most likely token (greedy).
            top_k: sample among the ``top_k`` most likely tokens only.
            top_p: sample among the smallest set of most likely tokens whose probability reaches ``top_p``.
            generator: the random stream (for reproducible samples).
            use_cache: reuse the keys and values of earlier tokens.
            on_step: called with the new tokens ``(b,)`` after each step; returning True stops.

        Returns:
            ``(b, s + n)``: the prompt and the ``n <= max_new_tokens`` new tokens.
        """
        was_training = self.training
        self.eval()
        try:
            return sample_loop(
                self,
                ids,
                max_new_tokens,
                temperature=temperature,
                top_k=top_k,
                top_p=top_p,
                generator=generator,
                use_cache=use_cache,
                on_step=on_step,
            )
        finally:
            self.train(was_training)
