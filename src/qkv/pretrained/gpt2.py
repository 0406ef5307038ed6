"""GPT-2 checkpoints in qkv's own :class:`~qkv.CausalLM`, and GPT-2's byte-level BPE tokenizer.

GPT-2 (Radford et al. 2019) is a decoder-only Transformer: pre-LN blocks of masked
self-attention and a GELU (tanh approximation) feed-forward network, learned absolute positions,
a final LayerNorm and the output projection tied to the token embedding; which is
:class:`~qkv.CausalLMConfig`'s default layout. A Hugging Face GPT-2 folder holds ``config.json``
(``"model_type": "gpt2"``), ``model.safetensors`` or ``pytorch_model.bin``, and
``tokenizer.json`` or ``vocab.json`` + ``merges.txt``.

The checkpoint's tensors are copied through the explicit map :func:`gpt2_key_map`, every shape
checked. Two things differ from qkv's layout: GPT-2's ``Conv1D`` stores its weight as
``(in, out)`` (transposed from ``nn.Linear``'s ``(out, in)``), and ``attn.c_attn`` packs the
query, key and value projections side by side, so it is split into ``q_proj``/``k_proj``/``v_proj``.
No Hugging Face modelling code runs.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as _RustTokenizer
from torch import Tensor

from qkv.models.causal_lm import CausalLM, CausalLMConfig
from qkv.pretrained.bert import _short_list, check_key_sets
from qkv.pretrained.tokenizer import QkvTextTokenizer, id_span, qkv_text_tokenizer, read_backend
from qkv.runtime.device import pick_device
from qkv.runtime.fileio import atomic_path
from qkv.runtime.safe_load import check_fits_weights, check_layer_counts

logger = logging.getLogger(__name__)

# Hugging Face ``activation_function`` names -> qkv.nn.layers activation names.
GPT2_ACTIVATIONS = {
    "gelu_new": "gelu_tanh",  # GPT-2's: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_fast": "gelu_tanh",  # the same formula, written differently
    "gelu": "gelu",  # exact (erf) GELU
    "relu": "relu",
}
# Per-layer buffers older checkpoints carry that are not weights (the causal mask and its fill value).
IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias")
END_OF_TEXT = "<|endoftext|>"


def gpt2_config(data: Mapping) -> CausalLMConfig:
    """A :class:`~qkv.CausalLMConfig` from a Hugging Face GPT-2 ``config.json`` dict.

    Raises:
        ValueError: not a GPT-2 config, or an option qkv's decoder does not have (cross-attention,
            attention scaled by layer index or not scaled, an unknown activation), or a bad size.
    """
    if data.get("model_type") != "gpt2":
        raise ValueError(f"not a GPT-2 config: model_type={data.get('model_type')!r}")
    if data.get("add_cross_attention"):
        raise ValueError("unsupported GPT-2 config: add_cross_attention (qkv.CausalLM has no cross-attention)")
    if data.get("scale_attn_by_inverse_layer_idx"):
        raise ValueError("unsupported GPT-2 config: scale_attn_by_inverse_layer_idx")
    if data.get("scale_attn_weights", True) is False:
        raise ValueError("unsupported GPT-2 config: scale_attn_weights=false (qkv always scales by 1/sqrt(d_head))")
    activation = data.get("activation_function", "gelu_new")
    if activation not in GPT2_ACTIVATIONS:
        raise ValueError(f"unsupported activation_function {activation!r}; supported: {sorted(GPT2_ACTIVATIONS)}")
    d_model = data.get("n_embd", 768)
    n_inner = data.get("n_inner")
    resid, embd = data.get("resid_pdrop", 0.1), data.get("embd_pdrop", 0.1)
    if embd != resid:  # qkv's CausalLM has one dropout rate for the embeddings and the residual branches
        logger.info("GPT-2 embd_pdrop=%s differs from resid_pdrop=%s; qkv uses %s for both", embd, resid, resid)
    return CausalLMConfig(
        vocab_size=data.get("vocab_size", 50257),
        d_model=d_model,
        num_heads=data.get("n_head", 12),
        num_layers=data.get("n_layer", 12),
        d_ff=n_inner if n_inner is not None else 4 * d_model,
        context=data.get("n_positions", 1024),
        dropout=resid,
        attention_dropout=data.get("attn_pdrop", 0.1),
        activation=GPT2_ACTIVATIONS[activation],
        norm_first=True,
        layer_norm_eps=data.get("layer_norm_epsilon", 1e-5),
        positional="learned",
        scale_embedding=False,
        tie_output=data.get("tie_word_embeddings", True) is not False,
        bias=True,
    )


@dataclass(frozen=True)
class KeyTarget:
    """Where one GPT-2 tensor goes: ``targets`` (several when a packed tensor is split along its
    output dimension) and whether it is a ``Conv1D`` weight stored ``(in, out)``."""

    targets: tuple[str, ...]
    conv1d: bool = False


def gpt2_key_map(config: CausalLMConfig) -> dict[str, KeyTarget]:
    """GPT-2 parameter name (``GPT2Model``'s, no ``transformer.`` prefix) -> :class:`~qkv.CausalLM`
    parameter name(s), listed in full; ``lm_head.weight`` only when the output is not tied."""
    names = {
        "wte.weight": KeyTarget(("token_embedding.weight",)),
        "wpe.weight": KeyTarget(("positional.embedding.weight",)),
        "ln_f.weight": KeyTarget(("decoder.norm.weight",)),
        "ln_f.bias": KeyTarget(("decoder.norm.bias",)),
    }
    for i in range(config.num_layers):
        hf, ours = f"h.{i}.", f"decoder.layers.{i}."
        qkv_proj = tuple(f"{ours}self_attn.{p}_proj" for p in "qkv")
        names[hf + "attn.c_attn.weight"] = KeyTarget(tuple(p + ".weight" for p in qkv_proj), conv1d=True)
        names[hf + "attn.c_attn.bias"] = KeyTarget(tuple(p + ".bias" for p in qkv_proj))
        for gpt2_name, qkv_name in (
            ("attn.c_proj", "self_attn.out_proj"),
            ("mlp.c_fc", "feed_forward.linear1"),
            ("mlp.c_proj", "feed_forward.linear2"),
        ):
            names[f"{hf}{gpt2_name}.weight"] = KeyTarget((f"{ours}{qkv_name}.weight",), conv1d=True)
            names[f"{hf}{gpt2_name}.bias"] = KeyTarget((f"{ours}{qkv_name}.bias",))
        for gpt2_name, qkv_name in (("ln_1", "norm1"), ("ln_2", "norm2")):  # pre-LN: before attention / FFN
            for param in ("weight", "bias"):
                names[f"{hf}{gpt2_name}.{param}"] = KeyTarget((f"{ours}{qkv_name}.{param}",))
    if not config.tie_output:
        names["lm_head.weight"] = KeyTarget(("output_proj.weight",))
    return names


def normalize_gpt2_keys(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Bring a checkpoint's names to ``GPT2Model``'s: drop the ``transformer.`` prefix of
    ``GPT2LMHeadModel`` (its ``lm_head.weight`` is kept) and the non-weight ``attn.bias`` /
    ``attn.masked_bias`` buffers."""
    out = {}
    for key, value in state.items():
        if key.startswith("transformer."):
            key = key[len("transformer.") :]
        if key.endswith(IGNORED_SUFFIXES):
            continue
        out[key] = value
    return out


def _expected_shape(target_shapes: list[tuple[int, ...]], conv1d: bool) -> tuple[int, ...]:
    """The checkpoint shape that splits (along the output dimension) into ``target_shapes``."""
    first = target_shapes[0]
    shape = (sum(s[0] for s in target_shapes), *first[1:])
    return tuple(reversed(shape)) if conv1d and len(shape) == 2 else shape


class PretrainedCausalLM(CausalLM):
    """A :class:`~qkv.CausalLM` with GPT-2's weights, and the tokenizer and name of the folder it
    was read from (both set by :func:`load_gpt2`)."""

    def __init__(self, config: CausalLMConfig) -> None:
        super().__init__(config)
        self.tokenizer: GPT2Tokenizer | QkvTextTokenizer | None = None
        self.name = ""


def build_gpt2(
    config: CausalLMConfig, state: Mapping[str, Tensor], *, source: str = "checkpoint"
) -> PretrainedCausalLM:
    """Build a :class:`~qkv.CausalLM` and copy ``state`` into it through :func:`gpt2_key_map`.

    Args:
        config: the architecture (from :func:`gpt2_config`).
        state: GPT-2 tensors by name (``GPT2Model`` or ``GPT2LMHeadModel`` names; with a tied
            output an ``lm_head.weight`` is shape-checked and then ignored, as Hugging Face does).
        source: how to name the checkpoint in error messages.

    Raises:
        ValueError: keys are missing or unexpected, or a shape disagrees with the config; one line
            naming them.
    """
    state = normalize_gpt2_keys(state)
    # layer counts first: the key map (and the model) grow with config.json's n_layer
    check_layer_counts(
        state, {"n_layer": ("h.", config.num_layers)}, config_path="config.json", weights_path=source, only_more=True
    )
    key_map = gpt2_key_map(config)
    tied_head = state.get("lm_head.weight") if config.tie_output else None
    if tied_head is not None:
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    check_key_sets(state, key_map, source, "GPT-2")
    try:
        with torch.device("meta"):  # shapes first, no memory: config.json is compared before the model is built
            probe = CausalLM(config)
    except (TypeError, ValueError, RuntimeError, OverflowError) as err:
        raise ValueError(f"{source}: config.json describes no model qkv can build ({_first_line(err)})") from None
    params = dict(probe.named_parameters())  # a tied output_proj.weight is listed once, as token_embedding
    mapped = {t for entry in key_map.values() for t in entry.targets}
    if mapped != set(params):  # the map itself is the contract; guard it
        raise RuntimeError(f"gpt2_key_map disagrees with CausalLM: {sorted(mapped ^ set(params))}")
    expected = {
        hf: _expected_shape([tuple(params[t].shape) for t in entry.targets], entry.conv1d)
        for hf, entry in key_map.items()
    }
    if tied_head is not None:
        expected["lm_head.weight"] = tuple(params["token_embedding.weight"].shape)
    given = dict(state, **({} if tied_head is None else {"lm_head.weight": tied_head}))
    wrong = [
        f"{hf} {tuple(given[hf].shape)} vs expected {shape}"
        for hf, shape in expected.items()
        if tuple(given[hf].shape) != shape
    ]
    if wrong:
        raise ValueError(f"{source}: tensor shapes disagree with config.json: {_short_list(wrong, 4)}")
    check_fits_weights(
        probe, sum(t.numel() * 4 for t in state.values()), config_path="config.json", weights_path=source
    )
    model = PretrainedCausalLM(config)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for hf, entry in key_map.items():
            tensor = state[hf]
            if not tensor.dtype.is_floating_point:
                raise ValueError(f"{source}: {hf} has dtype {tensor.dtype}, expected a floating-point tensor")
            if entry.conv1d:
                tensor = tensor.t()  # (in, out) -> nn.Linear's (out, in)
            for target, part in zip(entry.targets, tensor.chunk(len(entry.targets), dim=0)):
                params[target].copy_(part.to(params[target].dtype))
    return model.eval()


class GPT2Tokenizer:
    """GPT-2's byte-level BPE (the ``tokenizers`` library), with the interface qkv's language-model
    code uses: :meth:`encode`, :meth:`decode`, :attr:`vocab_size`, :meth:`tokens`, :meth:`save`.

    Every string encodes (256 byte symbols underlie the merges) and ``decode(encode(x)) == x``.
    No BOS/EOS is added; ``<|endoftext|>`` in the text is the special token (:attr:`eos_id`).
    """

    def __init__(self, backend: _RustTokenizer) -> None:
        self.backend = backend
        self.eos_id: int | None = backend.token_to_id(END_OF_TEXT)

    @classmethod
    def from_folder(cls, folder: str | Path) -> GPT2Tokenizer:
        """``tokenizer.json``, else ``vocab.json`` + ``merges.txt`` (with the added tokens of
        ``tokenizer_config.json`` when there is one).

        Raises:
            FileNotFoundError: neither is there. ValueError: a file cannot be read as a tokenizer.
        """
        folder = Path(folder)
        single, vocab, merges = folder / "tokenizer.json", folder / "vocab.json", folder / "merges.txt"
        if single.is_file():
            return cls(read_backend(single))
        if vocab.is_file() and merges.is_file():
            return cls.from_vocab_merges(vocab, merges, folder / "tokenizer_config.json")
        raise FileNotFoundError(f"{folder}: no tokenizer.json, nor vocab.json and merges.txt")

    @classmethod
    def from_vocab_merges(
        cls, vocab: str | Path, merges: str | Path, tokenizer_config: str | Path | None = None
    ) -> GPT2Tokenizer:
        """Build GPT-2's tokenizer from its ``vocab.json`` and ``merges.txt``: byte-level
        pre-tokenisation (GPT-2's regex), BPE, byte-level decoding."""
        settings = {}
        if tokenizer_config is not None and Path(tokenizer_config).is_file():
            try:
                settings = json.loads(Path(tokenizer_config).read_text(encoding="utf-8"))
            except (json.JSONDecodeError, UnicodeDecodeError) as err:
                raise ValueError(f"{tokenizer_config}: not valid JSON ({_first_line(err)})") from None
            settings = settings if isinstance(settings, dict) else {}
        try:
            bpe = models.BPE.from_file(
                str(vocab), str(merges), continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False
            )
        except Exception as err:
            raise ValueError(f"{vocab}, {merges}: not a valid BPE vocabulary ({_first_line(err)})") from None
        backend = _RustTokenizer(bpe)
        add_prefix_space = settings.get("add_prefix_space") is True
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=True)
        backend.decoder = decoders.ByteLevel()
        added: dict[str, int] = {}  # token -> id
        end_of_text = backend.token_to_id(END_OF_TEXT)
        if end_of_text is not None:
            added[END_OF_TEXT] = end_of_text
        for index, entry in (settings.get("added_tokens_decoder") or {}).items():
            if isinstance(entry, dict) and isinstance(entry.get("content"), str) and str(index).isdigit():
                added[entry["content"]] = int(index)
        for content, index in sorted(added.items(), key=lambda item: item[1]):
            if backend.token_to_id(content) is None and index != backend.get_vocab_size():
                raise ValueError(
                    f"{tokenizer_config}: added token {content!r} has id {index}, "
                    f"but the vocabulary has {backend.get_vocab_size()} entries"
                )
            backend.add_special_tokens([AddedToken(content, special=True, normalized=False)])
            if backend.token_to_id(content) != index:
                raise ValueError(
                    f"{tokenizer_config}: added token {content!r} has id {index}, "
                    f"but {vocab} gives it {backend.token_to_id(content)}"
                )
        return cls(backend)

    @property
    def vocab_size(self) -> int:
        """The ids an embedding must cover (the highest id plus one, added tokens included)."""
        return id_span(self.backend)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (nothing added around it)."""
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``, special tokens included (a byte sequence cut inside a UTF-8 character
        shows as U+FFFD)."""
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=False)

    def tokens(self, text: str) -> list[str]:
        """Readable token strings of ``text``: each token's bytes as text (``'Ġthe'`` -> ``' the'``;
        part of a multi-byte character shows as U+FFFD)."""
        return [self.decode([i]) for i in self.encode(text)]

    def save(self, path: str | Path) -> None:
        """Write ``tokenizer.json`` atomically (see :mod:`qkv.runtime.fileio`)."""
        with atomic_path(path) as tmp:
            self.backend.save(str(tmp))


def read_gpt2_config(folder: str | Path) -> CausalLMConfig:
    """Read and validate ``config.json`` of a GPT-2 folder (``ValueError`` naming the file)."""
    from qkv.pretrained import read_config_dict  # here: the package imports this module

    path = Path(folder) / "config.json"
    try:
        return gpt2_config(read_config_dict(folder))
    except (TypeError, ValueError) as err:
        message = _first_line(err)
        raise ValueError(message if message.startswith(str(path)) else f"{path}: {message}") from err


def load_gpt2(
    folder: str | Path, device: str | torch.device | None = None
) -> tuple[PretrainedCausalLM, GPT2Tokenizer | QkvTextTokenizer]:
    """Load a Hugging Face GPT-2 folder into qkv's :class:`~qkv.CausalLM`.

    Args:
        folder: holds ``config.json`` (``"model_type": "gpt2"``), ``model.safetensors`` or
            ``pytorch_model.bin`` (``GPT2Model`` or ``GPT2LMHeadModel``), and ``tokenizer.json``
            or ``vocab.json`` + ``merges.txt``.
        device: where to put the model; defaults to CUDA when available, else CPU
            (:func:`qkv.runtime.device.pick_device`).

    Returns:
        ``(model in eval mode, tokenizer)``; the tokenizer is also ``model.tokenizer``.

    Raises:
        FileNotFoundError: the folder or a required file is missing.
        ValueError: a bad device or config, corrupt weights, missing/unexpected keys or shapes that
            disagree with the config (one line naming them), a tokenizer larger than the vocabulary.
    """
    from qkv.pretrained import read_weights  # here: the package imports this module

    device = pick_device(device)  # before any loading: a bad device fails at once
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder}: checkpoint folder not found")
    config = read_gpt2_config(folder)
    state, weights_file = read_weights(folder)
    model = build_gpt2(config, state, source=str(weights_file))
    own = qkv_text_tokenizer(folder)  # a folder qkv wrote: its run's tokenizer class
    tokenizer = GPT2Tokenizer.from_folder(folder) if own is None else own
    if tokenizer.vocab_size > config.vocab_size:
        raise ValueError(
            f"{folder}: tokenizer has {tokenizer.vocab_size} tokens but config vocab_size is {config.vocab_size}"
        )
    model.tokenizer = tokenizer
    model.name = folder.name
    logger.debug(
        "loaded %s (%d layers, %d heads, d=%d) from %s",
        folder.name,
        config.num_layers,
        config.num_heads,
        config.d_model,
        weights_file,
    )
    return model.to(device), tokenizer


def _first_line(err: BaseException, limit: int = 200) -> str:
    text = (str(err).strip() or type(err).__name__).splitlines()[0]
    return text if len(text) <= limit else text[: limit - 3] + "..."


__all__ = [
    "GPT2Tokenizer",
    "build_gpt2",
    "gpt2_config",
    "gpt2_key_map",
    "load_gpt2",
    "normalize_gpt2_keys",
    "read_gpt2_config",
]
