"""BERT-family encoders in qkv's own layers, and the explicit key map from Hugging Face checkpoints.

BERT (Devlin et al. 2019) is the Transformer encoder of "Attention Is All You Need" with post-LN
layers, GELU feed-forward networks, learned absolute positions and token-type (segment)
embeddings. Every layer here is a :class:`qkv.nn.layers.EncoderLayer`, so the attention that runs is
qkv's :class:`qkv.MultiHeadAttention`; no Hugging Face modelling code is used.

Shape legend: ``b`` batch, ``s`` sequence length, ``d`` hidden size, ``h`` heads, ``V`` vocabulary.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from qkv.nn.dropout import Dropout
from qkv.nn.layers import EncoderLayer
from qkv.runtime.safe_load import check_fits_weights, check_layer_counts

if TYPE_CHECKING:  # the tokenizers library is imported where a tokenizer is read
    from qkv.pretrained.tokenizer import WordPieceTokenizer

logger = logging.getLogger(__name__)

# Hugging Face ``hidden_act`` names -> qkv.nn.layers activation names.
HF_ACTIVATIONS = {
    "gelu": "gelu",  # exact (erf) GELU
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "relu": "relu",
}
SUPPORTED_MODEL_TYPES = ("bert",)
# Buffers some checkpoints carry that are not weights (BERT's position ids 0..max-1).
IGNORED_KEYS = ("embeddings.position_ids",)


@dataclass
class BertConfig:
    """The architecture of a BERT-family encoder, read from a Hugging Face ``config.json``."""

    vocab_size: int = 30522  # word-piece vocabulary size
    hidden_size: int = 768  # model width d
    num_hidden_layers: int = 12  # encoder layers
    num_attention_heads: int = 12  # heads h; hidden_size must be divisible by it
    intermediate_size: int = 3072  # feed-forward inner width
    hidden_act: str = "gelu"  # feed-forward activation (Hugging Face name)
    hidden_dropout_prob: float = 0.1  # residual and embedding dropout
    attention_probs_dropout_prob: float = 0.1  # dropout on attention weights
    max_position_embeddings: int = 512  # longest input, in tokens
    type_vocab_size: int = 2  # token types (segments A/B)
    layer_norm_eps: float = 1e-12  # LayerNorm epsilon
    pad_token_id: int = 0  # padding id (attention masks come from the tokenizer, not from this)

    def __post_init__(self) -> None:
        if self.hidden_act not in HF_ACTIVATIONS:
            raise ValueError(f"unsupported hidden_act {self.hidden_act!r}; supported: {sorted(HF_ACTIVATIONS)}")
        for name in (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "intermediate_size",
            "max_position_embeddings",
            "type_vocab_size",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"config {name} must be a positive integer, got {value!r}")
        for name in ("hidden_dropout_prob", "attention_probs_dropout_prob", "layer_norm_eps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"config {name} must be a number, got {value!r}")
        for name in ("hidden_dropout_prob", "attention_probs_dropout_prob"):
            if not 0 <= getattr(self, name) < 1:  # also rejects NaN
                raise ValueError(f"config {name} must be in [0, 1), got {getattr(self, name)!r}")
        if not 0 < self.layer_norm_eps < 1:
            raise ValueError(f"config layer_norm_eps must be in (0, 1), got {self.layer_norm_eps!r}")
        pad = self.pad_token_id
        if not isinstance(pad, int) or isinstance(pad, bool) or not 0 <= pad < self.vocab_size:
            raise ValueError(f"config pad_token_id must be an id below vocab_size, got {pad!r}")
        if self.hidden_size % self.num_attention_heads != 0:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads "
                f"({self.num_attention_heads})"
            )

    @classmethod
    def from_hf_dict(cls, data: Mapping) -> BertConfig:
        """Read a Hugging Face BERT ``config.json`` dict; reject architectures this encoder cannot run.

        Raises:
            ValueError: the model type, position embedding type or a decoder option is unsupported.
        """
        model_type = data.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            archs = data.get("architectures")
            raise ValueError(
                f"unsupported architecture: model_type={model_type!r} (architectures={archs}); "
                f"qkv.load_pretrained reads {', '.join(SUPPORTED_MODEL_TYPES)} checkpoints"
            )
        position_type = data.get("position_embedding_type", "absolute")
        if position_type != "absolute":
            raise ValueError(f"unsupported position_embedding_type {position_type!r}; only 'absolute' is supported")
        if data.get("is_decoder") or data.get("add_cross_attention"):
            raise ValueError("unsupported BERT config: is_decoder/add_cross_attention models are not encoders")
        known = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in known and v is not None}
        return cls(**kwargs)


@dataclass
class BertOutput:
    """What :class:`BertEncoder` returns."""

    last_hidden_state: Tensor  # (b, s, d)
    pooler_output: Tensor | None = None  # (b, d) tanh(W h_[CLS] + b), if the checkpoint has a pooler
    attentions: list[Tensor] | None = None  # one (b, h, s, s) tensor per layer, if asked


class BertEmbeddings(nn.Module):
    """word + absolute position + token type embeddings, then LayerNorm and dropout."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        d = config.hidden_size
        self.word_embeddings = nn.Embedding(config.vocab_size, d, padding_idx=config.pad_token_id)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, d)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, d)
        self.norm = nn.LayerNorm(d, eps=config.layer_norm_eps)
        self.dropout = Dropout(config.hidden_dropout_prob)

    def forward(self, input_ids: Tensor, token_type_ids: Tensor) -> Tensor:
        """Token, position and token type embeddings, normalized: ``(b, s, d)``."""
        positions = torch.arange(input_ids.size(1), device=input_ids.device)  # (s,)
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions)[None]  # (b, s, d)
        x = x + self.token_type_embeddings(token_type_ids)
        return self.dropout(self.norm(x))  # (b, s, d)


class BertPooler(nn.Module):
    """BERT's pooler: ``tanh(W h_[CLS] + b)`` over the first token's final state."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, hidden: Tensor) -> Tensor:
        """The pooled output ``(b, d)``: the first token's hidden state through a dense layer and tanh."""
        return torch.tanh(self.dense(hidden[:, 0]))  # (b, d)


class BertEncoder(nn.Module):
    """A BERT-family encoder built from qkv's post-LN :class:`~qkv.nn.layers.EncoderLayer`.

    Args:
        config: the architecture (see :class:`BertConfig`).
        with_pooler: build the ``[CLS]`` pooler (checkpoints saved from ``BertModel`` have one).

    The matching tokenizer, when loaded with :func:`qkv.load_pretrained`, is ``model.tokenizer``.
    """

    def __init__(self, *, config: BertConfig, with_pooler: bool = True) -> None:
        super().__init__()
        self.config = config
        self.embeddings = BertEmbeddings(config)
        layers = [
            EncoderLayer(
                d_model=config.hidden_size,
                num_heads=config.num_attention_heads,
                d_ff=config.intermediate_size,
                dropout=config.hidden_dropout_prob,
                attention_dropout=config.attention_probs_dropout_prob,
                activation=HF_ACTIVATIONS[config.hidden_act],
                norm_first=False,  # BERT is post-LN, like the paper
                layer_norm_eps=config.layer_norm_eps,
            )
            for _ in range(config.num_hidden_layers)
        ]
        for layer in layers:
            # BERT has no dropout between the feed-forward activation and its second projection.
            layer.feed_forward.dropout = Dropout(0.0)
        self.layers = nn.ModuleList(layers)
        self.pooler = BertPooler(config) if with_pooler else None
        self.tokenizer: WordPieceTokenizer | None = None  # set by qkv.load_pretrained
        self.name = ""  # the checkpoint folder's name, set by qkv.load_pretrained

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        output_attentions: bool = False,
    ) -> BertOutput:
        """Encode token ids.

        Args:
            input_ids: ``(b, s)`` word-piece ids.
            attention_mask: ``(b, s)``, 1/True = real token, 0/False = padding (Hugging Face's
                convention, and qkv's). Defaults to all real.
            token_type_ids: ``(b, s)`` segment ids; defaults to zeros.
            output_attentions: also return every layer's attention weights. Those layers then run
                the eager reference attention, so the weights are the ones that produced the output.

        Returns:
            :class:`BertOutput` with ``last_hidden_state (b, s, d)``, ``pooler_output (b, d)``
            (None without a pooler) and ``attentions`` (per layer ``(b, h, s, s)``, or None).
        """
        self._check_inputs(input_ids, attention_mask, token_type_ids)
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        key_padding_mask = None if attention_mask is None else attention_mask.bool()  # (b, s) True = real
        x = self.embeddings(input_ids, token_type_ids)  # (b, s, d)
        attentions: list[Tensor] | None = [] if output_attentions else None
        for layer in self.layers:
            out = layer(x, key_padding_mask=key_padding_mask, need_weights=output_attentions)
            x = out.output
            if attentions is not None:
                attentions.append(out.self_weights)
        pooled = self.pooler(x) if self.pooler is not None else None
        return BertOutput(last_hidden_state=x, pooler_output=pooled, attentions=attentions)

    def _check_inputs(self, input_ids: Tensor, attention_mask: Tensor | None, token_type_ids: Tensor | None) -> None:
        if input_ids.dim() != 2 or input_ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"input_ids must be integer (batch, seq), got {input_ids.dtype} {tuple(input_ids.shape)}")
        s = input_ids.size(1)
        if s > self.config.max_position_embeddings:
            raise ValueError(f"input has {s} tokens; this model takes at most {self.config.max_position_embeddings}")
        if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= self.config.vocab_size):
            raise ValueError(
                f"input_ids must lie in [0, {self.config.vocab_size}), got min {int(input_ids.min())}, "
                f"max {int(input_ids.max())}"
            )
        for name, t in (("attention_mask", attention_mask), ("token_type_ids", token_type_ids)):
            if t is not None and t.shape != input_ids.shape:
                raise ValueError(f"{name} has shape {tuple(t.shape)}, input_ids {tuple(input_ids.shape)}")
        types = self.config.type_vocab_size
        if token_type_ids is not None and token_type_ids.numel() and int(token_type_ids.max()) >= types:
            raise ValueError(f"token_type_ids must be < type_vocab_size={types}, got {int(token_type_ids.max())}")


def bert_key_map(config: BertConfig, *, with_pooler: bool) -> dict[str, str]:
    """Hugging Face ``BertModel`` parameter name -> :class:`BertEncoder` parameter name, listed in full."""
    names = {
        "embeddings.word_embeddings.weight": "embeddings.word_embeddings.weight",
        "embeddings.position_embeddings.weight": "embeddings.position_embeddings.weight",
        "embeddings.token_type_embeddings.weight": "embeddings.token_type_embeddings.weight",
        "embeddings.LayerNorm.weight": "embeddings.norm.weight",
        "embeddings.LayerNorm.bias": "embeddings.norm.bias",
    }
    per_layer = {
        "attention.self.query": "self_attn.q_proj",
        "attention.self.key": "self_attn.k_proj",
        "attention.self.value": "self_attn.v_proj",
        "attention.output.dense": "self_attn.out_proj",
        "attention.output.LayerNorm": "norm1",  # post-LN after attention + residual
        "intermediate.dense": "feed_forward.linear1",
        "output.dense": "feed_forward.linear2",
        "output.LayerNorm": "norm2",  # post-LN after feed-forward + residual
    }
    for i in range(config.num_hidden_layers):
        for hf, ours in per_layer.items():
            for param in ("weight", "bias"):
                names[f"encoder.layer.{i}.{hf}.{param}"] = f"layers.{i}.{ours}.{param}"
    if with_pooler:
        names["pooler.dense.weight"] = "pooler.dense.weight"
        names["pooler.dense.bias"] = "pooler.dense.bias"
    return names


def normalize_checkpoint_keys(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Bring a checkpoint's names to ``BertModel``'s: drop a ``bert.`` prefix (``BertFor...`` models,
    whose task heads outside it are skipped and logged), rename TF-era ``gamma``/``beta``, and drop
    non-weight buffers such as ``position_ids``."""
    if any(k.startswith("bert.") for k in state):
        heads = sorted(k for k in state if not k.startswith("bert."))
        if heads:
            logger.info("skipping %d task-head tensors outside the encoder: %s", len(heads), heads)
        state = {k[len("bert.") :]: v for k, v in state.items() if k.startswith("bert.")}
    out = {}
    for key, value in state.items():
        if key in IGNORED_KEYS:
            continue
        if key.endswith("LayerNorm.gamma"):
            key = key[: -len("gamma")] + "weight"
        elif key.endswith("LayerNorm.beta"):
            key = key[: -len("beta")] + "bias"
        out[key] = value
    return out


def check_key_sets(state: dict, key_map: dict, source: object, family: str) -> None:
    """``ValueError`` in one line listing the checkpoint keys ``key_map`` lacks and the ones it
    expects that ``state`` lacks (a pretrained loader's first check)."""
    missing = sorted(set(key_map) - set(state))
    unexpected = sorted(set(state) - set(key_map))
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing keys: {_short_list(missing)}")
        if unexpected:
            parts.append(f"unexpected keys: {_short_list(unexpected)}")
        raise ValueError(f"{source}: weights do not match the {family} config ({'; '.join(parts)})")


def _short_list(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return f"{shown}, ... ({len(names)} in all)" if len(names) > limit else shown


def build_bert(config: BertConfig, state: Mapping[str, Tensor], *, source: str = "checkpoint") -> BertEncoder:
    """Build a :class:`BertEncoder` and copy ``state`` into it through :func:`bert_key_map`.

    Args:
        config: the architecture.
        state: Hugging Face tensors by name (``bert.`` prefixes and gamma/beta names accepted).
        source: how to name the checkpoint in error messages.

    Raises:
        ValueError: keys are missing or unexpected, or a tensor's shape disagrees with the config;
            the message lists them.
    """
    state = normalize_checkpoint_keys(state)
    with_pooler = "pooler.dense.weight" in state or "pooler.dense.bias" in state
    # layer counts first: the key map (and the model) grow with config.json's num_hidden_layers
    check_layer_counts(
        state,
        {"num_hidden_layers": ("encoder.layer.", config.num_hidden_layers)},
        config_path="config.json",
        weights_path=source,
        only_more=True,
    )
    key_map = bert_key_map(config, with_pooler=with_pooler)
    check_key_sets(state, key_map, source, "BERT")
    try:
        with torch.device("meta"):  # shapes first, no memory: config.json is compared before the model is built
            probe = BertEncoder(config=config, with_pooler=with_pooler)
    except (TypeError, ValueError, RuntimeError, OverflowError) as err:
        raise ValueError(
            f"{source}: config.json describes no model qkv can build ({str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__})"
        ) from None
    params = dict(probe.named_parameters())
    if set(params) != set(key_map.values()):  # the map itself is the contract; guard it
        raise RuntimeError(f"bert_key_map disagrees with BertEncoder: {sorted(set(params) ^ set(key_map.values()))}")
    wrong = [
        f"{hf} {tuple(state[hf].shape)} vs expected {tuple(params[ours].shape)}"
        for hf, ours in key_map.items()
        if tuple(state[hf].shape) != tuple(params[ours].shape)
    ]
    if wrong:
        raise ValueError(f"{source}: tensor shapes disagree with config.json: {_short_list(wrong, 4)}")
    check_fits_weights(
        probe, sum(t.numel() * 4 for t in state.values()), config_path="config.json", weights_path=source
    )
    model = BertEncoder(config=config, with_pooler=with_pooler)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for hf, ours in key_map.items():
            tensor = state[hf]
            if not tensor.dtype.is_floating_point:
                raise ValueError(f"{source}: {hf} has dtype {tensor.dtype}, expected a floating-point tensor")
            params[ours].copy_(tensor.to(params[ours].dtype))
    return model.eval()
