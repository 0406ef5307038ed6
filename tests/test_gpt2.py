"""GPT-2 folders read into qkv's own CausalLM (qkv.pretrained.gpt2), checked against Hugging Face
transformers' GPT2Model / GPT2LMHeadModel (eager attention) and its GPT2Tokenizer on tiny random
models and a small byte-level BPE trained here."""

from __future__ import annotations

import json

import pytest
import torch

import qkv
from qkv.pretrained.gpt2 import GPT2Tokenizer, build_gpt2, gpt2_config, load_gpt2

transformers = pytest.importorskip("transformers")
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402

CORPUS = [
    "The quick brown fox jumps over the lazy dog. The dog sleeps.",
    "Attention is all you need; the transformer attends to every token before it.",
    "naïve café über 😀 emoji, numbers 12345 and 67.\n\tIndented new lines\n",
    "Hello world! hello World? HELLO, world... <|endoftext|> Another document starts here.",
] * 5
STRINGS = [
    "Hello world",
    " the quick brown fox",
    "naïve café — 😀!",
    "a<|endoftext|>b <|endoftext|>",
    "x  \n\n  y\t",
    "Attention is all you need",
    "",
]
TINY = dict(
    n_embd=32,
    n_layer=2,
    n_head=4,
    n_positions=64,
    bos_token_id=0,
    eos_token_id=0,
    resid_pdrop=0.0,
    embd_pdrop=0.0,
    attn_pdrop=0.0,
    attn_implementation="eager",
)


def perturb(model: torch.nn.Module, seed: int = 0) -> None:
    """Move every parameter off its initial value (biases are zeros and LayerNorms ones at
    initialisation), so a bias or LayerNorm copied to the wrong place shows."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * 0.05)


def train_tokenizer(vocab_size: int = 320) -> Tokenizer:
    """A small GPT-2-style byte-level BPE with ``<|endoftext|>`` as id 0."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    assert tok.get_vocab_size() == vocab_size and tok.token_to_id("<|endoftext|>") == 0
    return tok


@pytest.fixture(scope="module")
def bpe() -> Tokenizer:
    return train_tokenizer()


def make_gpt2_folder(
    folder, bpe: Tokenizer, *, weights: str = "safetensors", tokenizer: str = "json", **overrides
) -> transformers.GPT2LMHeadModel:
    """A random GPT2LMHeadModel saved into ``folder`` with the tokenizer. ``weights``:
    ``safetensors`` (save_pretrained) or ``bin`` (a pytorch_model.bin of GPT2Model names without
    the ``transformer.`` prefix, with the old ``attn.bias``/``attn.masked_bias`` buffers, as the
    original GPT-2 checkpoints have). ``tokenizer``: ``json`` or ``vocab_merges``."""
    config = transformers.GPT2Config(**dict(TINY, vocab_size=bpe.get_vocab_size(), **overrides))
    torch.manual_seed(1)
    model = transformers.GPT2LMHeadModel(config).eval()
    perturb(model)
    model.save_pretrained(str(folder))
    if weights == "bin":
        (folder / "model.safetensors").unlink()
        state = {k.removeprefix("transformer."): v.clone() for k, v in model.state_dict().items()}
        if config.tie_word_embeddings:
            state.pop("lm_head.weight")
        n = config.n_positions
        for i in range(config.n_layer):
            state[f"h.{i}.attn.bias"] = torch.tril(torch.ones(n, n, dtype=torch.uint8)).view(1, 1, n, n)
            state[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
        torch.save(state, folder / "pytorch_model.bin")
    if tokenizer == "json":
        bpe.save(str(folder / "tokenizer.json"))
    else:
        bpe.model.save(str(folder))  # vocab.json + merges.txt
    return model


def test_gpt2_config_maps_every_field():
    config = gpt2_config(
        dict(
            model_type="gpt2",
            vocab_size=500,
            n_embd=48,
            n_head=6,
            n_layer=3,
            n_inner=100,
            n_positions=80,
            layer_norm_epsilon=1e-6,
            activation_function="relu",
            resid_pdrop=0.2,
            embd_pdrop=0.2,
            attn_pdrop=0.3,
        )
    )
    assert (config.vocab_size, config.d_model, config.num_heads, config.num_layers, config.d_ff, config.context) == (
        500,
        48,
        6,
        3,
        100,
        80,
    )
    assert (config.layer_norm_eps, config.activation, config.dropout, config.attention_dropout) == (
        1e-6,
        "relu",
        0.2,
        0.3,
    )
    assert config.norm_first and config.positional == "learned" and not config.scale_embedding
    assert config.tie_output and config.bias
    defaults = gpt2_config({"model_type": "gpt2"})
    # GPT-2 small is CausalLMConfig's default, but for GPT-2's attention dropout (attn_pdrop 0.1)
    assert defaults == qkv.CausalLMConfig(attention_dropout=0.1)
    assert gpt2_config({"model_type": "gpt2", "n_embd": 64, "n_head": 4}).d_ff == 256  # n_inner None: 4 * n_embd
    assert gpt2_config({"model_type": "gpt2", "activation_function": "gelu"}).activation == "gelu"


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        dict(n_inner=40, activation_function="gelu", layer_norm_epsilon=1e-3),
        dict(n_layer=3, n_head=2, activation_function="relu"),
    ],
)
def test_hidden_states_match_gpt2model(overrides):
    config = transformers.GPT2Config(**dict(TINY, vocab_size=301, **overrides))
    torch.manual_seed(0)
    hf = transformers.GPT2Model(config).eval()
    perturb(hf)
    ours = build_gpt2(gpt2_config(config.to_dict()), hf.state_dict())
    assert not ours.training
    ids = torch.randint(0, 301, (3, config.n_positions))
    with torch.no_grad():
        want = hf(ids).last_hidden_state  # after ln_f
        got = ours(ids).hidden
    assert got.shape == want.shape == (3, config.n_positions, 32)
    assert (got - want).abs().max() <= 1e-5
    # the output projection is the embedding (tied), as in GPT2LMHeadModel
    assert ours.output_proj.weight.data_ptr() == ours.token_embedding.weight.data_ptr()


@pytest.mark.parametrize("weights, tokenizer", [("safetensors", "json"), ("bin", "vocab_merges")])
def test_load_pretrained_gpt2_folder_matches_transformers(tmp_path, bpe, weights, tokenizer):
    hf = make_gpt2_folder(tmp_path, bpe, weights=weights, tokenizer=tokenizer)
    model = qkv.load_pretrained(tmp_path, device="cpu")
    assert isinstance(model, qkv.CausalLM) and not model.training
    assert isinstance(model.tokenizer, GPT2Tokenizer)
    hf_tok = transformers.GPT2Tokenizer.from_pretrained(str(tmp_path))
    for text in STRINGS:
        assert model.tokenizer.encode(text) == hf_tok.encode(text), text
        assert model.tokenizer.decode(model.tokenizer.encode(text)) == text
    assert model.tokenizer.vocab_size == len(hf_tok) == bpe.get_vocab_size()
    assert model.tokenizer.eos_id == 0
    prompts = [model.tokenizer.encode(s) for s in ("The quick brown fox jumps", "Attention is all you need")]
    ids = torch.randint(0, bpe.get_vocab_size(), (2, 64))  # the full context
    for row, prompt in enumerate(prompts):
        ids[row, : len(prompt)] = torch.tensor(prompt)
    with torch.no_grad():
        got = model(ids).logits
        want = hf(ids).logits
    assert got.shape == want.shape == (2, 64, bpe.get_vocab_size())
    assert (got - want).abs().max() <= 1e-4
    # load_gpt2 gives the same model and the tokenizer as a pair
    model2, tok2 = load_gpt2(tmp_path, device="cpu")
    assert tok2.encode("Hello world") == hf_tok.encode("Hello world")
    with torch.no_grad():
        assert torch.equal(model2(ids).logits, got)


def test_untied_output_loads_lm_head(tmp_path, bpe):
    hf = make_gpt2_folder(tmp_path, bpe, tie_word_embeddings=False)
    assert not torch.equal(hf.lm_head.weight, hf.transformer.wte.weight)
    model = qkv.load_pretrained(tmp_path, device="cpu")
    assert not model.config.tie_output
    ids = torch.randint(0, bpe.get_vocab_size(), (2, 10))
    with torch.no_grad():
        assert (model(ids).logits - hf(ids).logits).abs().max() <= 1e-4


def test_tokenizer_tokens_save_and_round_trip(tmp_path, bpe):
    bpe.save(str(tmp_path / "tokenizer.json"))
    tok = GPT2Tokenizer.from_folder(tmp_path)
    assert "Ġthe" in bpe.get_vocab() and tok.tokens(" the the") == [" the", " the"]  # 'Ġ' shown as a space
    assert "".join(tok.tokens("Hello world, the dog")) == "Hello world, the dog"
    tok.save(tmp_path / "saved" / "tokenizer.json")
    assert not list((tmp_path / "saved").glob(".*.tmp"))  # written atomically, no temporary left
    again = GPT2Tokenizer.from_folder(tmp_path / "saved")
    for text in STRINGS:
        assert again.encode(text) == tok.encode(text)
    assert again.vocab_size == tok.vocab_size


def one_line_error(call, error=ValueError) -> str:
    with pytest.raises(error) as info:
        call()
    message = str(info.value)
    assert message and "\n" not in message, message
    return message


def test_bad_folders_are_one_line_errors(tmp_path, bpe):
    from safetensors.torch import load_file, save_file

    make_gpt2_folder(tmp_path, bpe)
    weights = tmp_path / "model.safetensors"
    state = load_file(str(weights))

    save_file({k: v for k, v in state.items() if k != "transformer.h.1.mlp.c_fc.bias"}, str(weights))
    message = one_line_error(lambda: qkv.load_pretrained(tmp_path))
    assert "missing keys: h.1.mlp.c_fc.bias" in message and "model.safetensors" in message

    save_file(dict(state, **{"transformer.h.0.attn.extra": torch.zeros(3)}), str(weights))
    assert "unexpected keys: h.0.attn.extra" in one_line_error(lambda: qkv.load_pretrained(tmp_path))

    save_file(dict(state, **{"transformer.h.0.attn.c_attn.weight": torch.zeros(96, 32)}), str(weights))
    message = one_line_error(lambda: qkv.load_pretrained(tmp_path))
    assert "h.0.attn.c_attn.weight (96, 32) vs expected (32, 96)" in message  # Conv1D (in, out), not transposed

    save_file(dict(state, **{"transformer.wpe.weight": torch.zeros(65, 32)}), str(weights))
    assert "wpe.weight (65, 32) vs expected (64, 32)" in one_line_error(lambda: qkv.load_pretrained(tmp_path))
    save_file(state, str(weights))

    config = json.loads((tmp_path / "config.json").read_text())
    for bad, expected in [
        (dict(config, model_type="falcon"), "unsupported architecture: model_type='falcon'"),
        (dict(config, activation_function="swish"), "swish"),
        (dict(config, add_cross_attention=True), "add_cross_attention"),
        (dict(config, scale_attn_by_inverse_layer_idx=True), "scale_attn_by_inverse_layer_idx"),
        (dict(config, n_embd=30), "divisible"),
        (dict(config, n_layer=3), "config.json: n_layer is 3 but"),
        (dict(config, vocab_size=100), "wte.weight (320, 32) vs expected (100, 32)"),
    ]:
        (tmp_path / "config.json").write_text(json.dumps(bad))
        assert expected in one_line_error(lambda: qkv.load_pretrained(tmp_path)), bad
    (tmp_path / "config.json").write_text(json.dumps(config))

    (tmp_path / "tokenizer.json").unlink()
    assert "no tokenizer.json" in one_line_error(lambda: qkv.load_pretrained(tmp_path), FileNotFoundError)
    (tmp_path / "tokenizer.json").write_text("{not json")
    assert "tokenizer.json" in one_line_error(lambda: qkv.load_pretrained(tmp_path))
    bpe.save(str(tmp_path / "tokenizer.json"))
    assert "unknown device" in one_line_error(lambda: qkv.load_pretrained(tmp_path, device="gpu0"))
    assert isinstance(qkv.load_pretrained(tmp_path, device="cpu"), qkv.CausalLM)  # the folder is whole again
