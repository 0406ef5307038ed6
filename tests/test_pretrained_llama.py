"""transformers' Llama, Mistral and Qwen2 folders read into qkv's own CausalLM (qkv.pretrained.llama),
checked against LlamaForCausalLM / MistralForCausalLM / Qwen2ForCausalLM (eager attention) built with
random weights at small sizes, on tiny Shakespeare text through a small byte-level BPE trained here:
float32 logits within 1e-5, greedy generation identical to transformers' for 64 tokens with and
without qkv's cache, and one-line refusals of what qkv has no exact counterpart for."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch

import qkv
from qkv.pretrained.llama import PretrainedTokenizer, llama_config, load_llama

transformers = pytest.importorskip("transformers")
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers  # noqa: E402

SIZES = dict(
    vocab_size=384,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    bos_token_id=0,
    eos_token_id=None,  # transformers' generate stops at an EOS; qkv's runs its full length
    pad_token_id=None,
)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
}
NEW_TOKENS = 64
TOLERANCE = 1e-5


@functools.cache
def shakespeare_tokenizer(text_path: Path) -> Tokenizer:
    """A byte-level BPE of 384 tokens trained on the start of tiny Shakespeare; ``<s>`` is id 0."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=SIZES["vocab_size"],
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([text_path.read_text(encoding="utf-8")[:200_000]], trainer)
    assert tok.token_to_id("<s>") == 0 and tok.get_vocab_size() == SIZES["vocab_size"]
    return tok


@pytest.fixture
def shakespeare(tinyshakespeare_dir) -> tuple[Tokenizer, str]:
    """The tokenizer and a passage the tokenizer was not trained on."""
    path = tinyshakespeare_dir / "input.txt"
    text = path.read_text(encoding="utf-8")
    start = text.index("\n\n", 500_000) + 2  # a speaker's line, past the text the tokenizer learnt from
    return shakespeare_tokenizer(path), text[start : start + 300]


def perturb(model: torch.nn.Module, seed: int = 0) -> None:
    """Move every parameter off its initial value (norms start at ones, biases at zeros), so a norm
    or bias copied to the wrong place shows, and far enough that greedy continuations vary."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * 0.1)


def make_folder(folder: Path, family: str, tok: Tokenizer, *, bos: bool = True, shard: bool = False, **options):
    """Save a random ``family`` model (``options`` override :data:`SIZES`) and ``tok`` as transformers
    does; returns the transformers model in eval mode."""
    config_class, model_class = (getattr(transformers, name) for name in FAMILIES[family])
    torch.manual_seed(0)
    model = model_class(config_class(**{**SIZES, **options}))
    perturb(model)
    model.save_pretrained(folder, max_shard_size="50KB" if shard else "1GB")
    backend = Tokenizer.from_str(tok.to_str())
    if bos:  # Llama and Mistral tokenizers put <s> before a text; Qwen2's nothing
        backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(folder)
    model.set_attn_implementation("eager")  # the plainest reference
    return model.eval()


def check_against(hf_model, folder: Path, text: str) -> None:
    """qkv's model of ``folder`` against ``hf_model``: the tokenizer's ids, float32 logits on
    ``text``, and greedy generation with and without the cache."""
    lm = qkv.load_pretrained(folder, device="cpu")
    assert isinstance(lm.tokenizer, PretrainedTokenizer)
    ids = lm.tokenizer.encode(text)
    assert ids == transformers.AutoTokenizer.from_pretrained(folder)(text).input_ids
    batch = torch.tensor([ids[:96]])
    with torch.no_grad():
        expected = hf_model(batch).logits
        got = lm(batch).logits
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() <= TOLERANCE
    prompt = batch[:, :24]
    with torch.no_grad():
        reference = hf_model.generate(prompt, do_sample=False, max_new_tokens=NEW_TOKENS)
    assert reference.shape == (1, 24 + NEW_TOKENS)
    assert len(set(reference[0, 24:].tolist())) >= 3  # not one token repeated: each step's position matters
    for use_cache in (True, False):
        out = lm.generate(prompt, NEW_TOKENS, temperature=0, use_cache=use_cache)
        assert out.tolist() == reference.tolist(), f"use_cache={use_cache}"


def test_llama_with_llama3_rope_scaling_sharded(tmp_path, shakespeare):
    """Llama 3.1's frequency scaling, with an original context small enough that its low, smoothed
    and high bands all occur among the head's frequencies; the weights sharded over several files."""
    tok, text = shakespeare
    rope = dict(
        rope_type="llama3",
        rope_theta=500000.0,
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=64,
    )
    hf_model = make_folder(tmp_path, "llama", tok, shard=True, rope_parameters=rope)
    assert (tmp_path / "model.safetensors.index.json").is_file() and not (tmp_path / "model.safetensors").exists()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    config = llama_config(json.loads((tmp_path / "config.json").read_text()))
    assert (config.rotary_scaling, config.rotary_scaling_factor, config.rotary_original_context) == ("llama3", 8.0, 64)
    assert (config.rotary_base, config.num_kv_heads, config.norm, config.activation) == (500000.0, 2, "rms", "swiglu")
    check_against(hf_model, tmp_path, text)


def test_llama_with_linear_rope_in_the_older_config_form_tied_and_biased(tmp_path, shakespeare):
    """Linear rotary scaling written the way transformers 4 wrote it (top-level ``rope_theta``,
    ``rope_scaling`` with ``type``), a tied output, and biases on every projection."""
    tok, text = shakespeare
    hf_model = make_folder(
        tmp_path,
        "llama",
        tok,
        rope_parameters=dict(rope_type="linear", rope_theta=20000.0, factor=2.0),
        tie_word_embeddings=True,
        attention_bias=True,
        mlp_bias=True,
    )
    path = tmp_path / "config.json"
    data = json.loads(path.read_text())
    del data["rope_parameters"]
    data.update(rope_theta=20000.0, rope_scaling={"type": "linear", "factor": 2.0})
    path.write_text(json.dumps(data))
    old_form = transformers.LlamaForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    ids = torch.arange(40).unsqueeze(0)
    with torch.no_grad():  # transformers reads the older form as the same model
        assert torch.equal(old_form(ids).logits, hf_model(ids).logits)
    config = llama_config(data)
    assert (config.rotary_scaling, config.rotary_scaling_factor, config.rotary_base) == ("linear", 2.0, 20000.0)
    assert config.tie_output and config.bias and config.qkv_bias
    check_against(hf_model, tmp_path, text)


def test_mistral_with_a_sliding_window_shorter_than_the_text(tmp_path, shakespeare):
    """A window of 8 keys over ~90 tokens: every layer's window matters, in the prompt and through
    64 cached steps."""
    tok, text = shakespeare
    hf_model = make_folder(tmp_path, "mistral", tok, sliding_window=8)
    config = llama_config(json.loads((tmp_path / "config.json").read_text()))
    assert (config.sliding_window, config.sliding_window_layers) == (8, None)
    check_against(hf_model, tmp_path, text)
    ids = torch.arange(40).unsqueeze(0)
    with torch.no_grad():  # the window matters here: the same model without it gives other logits
        windowed = load(tmp_path)(ids).logits
        hf_model.config.sliding_window = None
        assert (hf_model(ids).logits - windowed).abs().max().item() > 1e-3


def load(folder: Path):
    """qkv's model of ``folder`` on the CPU."""
    return load_llama(folder, device="cpu")[0]


def test_qwen2_with_qkv_biases_and_a_window_on_later_layers(tmp_path, shakespeare):
    """Qwen2: biases on q/k/v only, grouped-query heads, a sliding window on layer 1 only (from
    ``max_window_layers``, saved by transformers 5 as ``layer_types``); no BOS."""
    tok, text = shakespeare
    hf_model = make_folder(
        tmp_path, "qwen2", tok, bos=False, use_sliding_window=True, sliding_window=8, max_window_layers=1
    )
    data = json.loads((tmp_path / "config.json").read_text())
    config = llama_config(data)
    assert (config.qkv_bias, config.bias, config.sliding_window, config.sliding_window_layers) == (True, False, 8, [1])
    del data["layer_types"]  # the older form: the layers from max_window_layers on
    assert llama_config(data) == config
    assert load(tmp_path).tokenizer.prefix == []
    check_against(hf_model, tmp_path, text)


def base(**fields) -> dict:
    """A Llama config.json dict at the test sizes, with ``fields`` set (None removes one)."""
    data = {**SIZES, "model_type": "llama", "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
    data.update(fields)
    return {k: v for k, v in data.items() if v is not None}


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        (
            {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}},
            "rope_type",
        ),
        ({"rope_parameters": None, "rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_scaling.type='dynamic'"),
        ({"head_dim": 32}, "head_dim"),
        ({"hidden_act": "gelu_pytorch_tanh"}, "hidden_act"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        ({"attention_bias": True}, "mlp_bias"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"quantization_config": {"quant_method": "bitsandbytes"}}, "quantization_config"),
        ({"model_type": "qwen2", "layer_types": ["sliding_attention"] * 2}, "layer_types"),
    ],
)
def test_configurations_without_an_exact_counterpart_are_refused_naming_the_field(fields, named):
    with pytest.raises(ValueError) as err:
        llama_config(base(**fields))
    message = str(err.value)
    assert named in message and "\n" not in message


def test_a_refusal_through_load_pretrained_names_the_file_and_field(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(base(head_dim=8)))
    with pytest.raises(ValueError, match=r"config\.json: head_dim=8 differs") as err:
        qkv.load_pretrained(tmp_path, device="cpu")
    assert "\n" not in str(err.value)


def test_the_bos_comes_from_tokenizer_config_when_it_says(tmp_path, shakespeare):
    """``add_bos_token`` in tokenizer_config.json puts the BOS first even where tokenizer.json's
    post-processor adds none (as transformers' Llama tokenizer before version 5 did), and false keeps
    it out where the post-processor adds one."""
    tok, text = shakespeare
    tok.save(str(tmp_path / "tokenizer.json"))  # no post-processor
    settings = tmp_path / "tokenizer_config.json"
    assert PretrainedTokenizer.from_folder(tmp_path).encode("Hi") == tok.encode("Hi").ids
    settings.write_text(json.dumps({"add_bos_token": True, "bos_token": {"content": "<s>"}}))
    assert PretrainedTokenizer.from_folder(tmp_path).encode("Hi") == [0, *tok.encode("Hi").ids]
    settings.write_text(json.dumps({"add_bos_token": True}))
    assert PretrainedTokenizer.from_folder(tmp_path, {"bos_token_id": 1}).prefix == [1]  # config.json's id
    with pytest.raises(ValueError, match="add_bos_token"):
        PretrainedTokenizer.from_folder(tmp_path)
    tok = Tokenizer.from_str(tok.to_str())
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tok.save(str(tmp_path / "tokenizer.json"))
    settings.unlink()
    assert PretrainedTokenizer.from_folder(tmp_path).prefix == [0]  # the post-processor's
    settings.write_text(json.dumps({"add_bos_token": False}))
    assert PretrainedTokenizer.from_folder(tmp_path).encode("Hi") == tok.encode("Hi", add_special_tokens=False).ids
