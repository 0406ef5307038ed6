"""``qkv export RUN --to hf`` and ``--to ctranslate2`` for a language model of today's shape: a Llama,
Mistral or Qwen2 folder that ``transformers`` loads and that gives qkv's logits, read back by
``qkv.load_pretrained`` into the same weights; a CTranslate2 ``Generator`` folder whose greedy
generations are qkv's on 200 prompts; and every configuration without an exact counterpart refused in
one line naming the field."""

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
ctranslate2 = pytest.importorskip("ctranslate2")

from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast  # noqa: E402

from qkv.cli import main  # noqa: E402
from qkv.data.text import CharTokenizer  # noqa: E402
from qkv.data.tokenizer import Tokenizer  # noqa: E402
from qkv.export.ctranslate2_lm import (  # noqa: E402
    MANIFEST,
    TIE_MARGIN,
    check_lm_folder,
    ct2_lm_refusal,
    generate_greedy,
    same_up_to_ties,
    write_lm_model,
)
from qkv.export.hf_llama import build_llama_model, export_causal_lm, llama_refusal, lm_refusal  # noqa: E402
from qkv.models.causal_lm import CausalLM, CausalLMConfig  # noqa: E402
from qkv.pretrained import load_pretrained  # noqa: E402
from qkv.runs.folder import load_run  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures" / "runs_v0_1"
TEXT = (
    "First Citizen: Before we proceed any further, hear me speak. All: Speak, speak. First Citizen: You are "
    "all resolved rather to die than to famish? All: Resolved. resolved. First Citizen: First, you know Caius "
    "Marcius is chief enemy to the people.\n"
)
TOKENIZER = CharTokenizer(TEXT)
# a Llama shape: RMSNorm, rotary, SwiGLU, pre-norm, no biases, untied output
LLAMA = dict(
    vocab_size=TOKENIZER.vocab_size,
    d_model=32,
    num_heads=4,
    num_layers=3,
    d_ff=48,
    context=64,
    dropout=0.0,
    norm="rms",
    activation="swiglu",
    positional="rotary",
    bias=False,
    tie_output=False,
    layer_norm_eps=1e-6,
)
FAMILY_SHAPES = {
    "llama-gqa": ("llama", dict(num_kv_heads=2, rotary_base=500.0)),
    "llama-biases-tied-geglu": ("llama", dict(bias=True, tie_output=True, activation="geglu", num_kv_heads=1)),
    "llama-linear-scaling": ("llama", dict(rotary_scaling="linear", rotary_scaling_factor=2.0)),
    "llama3-scaling": (
        "llama",
        dict(rotary_scaling="llama3", rotary_scaling_factor=4.0, rotary_original_context=16, num_kv_heads=2),
    ),
    "mistral-window": ("mistral", dict(sliding_window=5, num_kv_heads=2)),
    "qwen2-qkv-bias": ("qwen2", dict(qkv_bias=True, num_kv_heads=2)),
    "qwen2-window-on-some-layers": ("qwen2", dict(qkv_bias=True, sliding_window=4, sliding_window_layers=[1, 2])),
}
HF_CLASSES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}


def _model(noise: float = 0.1, **change) -> CausalLM:
    """A random model, every weight moved by ``noise`` from its initial value (0.3: logits far apart,
    so that greedy choices are not near-ties that other kernels' rounding could flip)."""
    torch.manual_seed(0)
    model = CausalLM(CausalLMConfig(**{**LLAMA, **change})).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * noise)
    return model


def _same_function_config(config: CausalLMConfig) -> CausalLMConfig:
    """The config with its defaults spelled out: a folder states num_kv_heads and qkv_bias."""
    qkv_bias = config.bias if config.qkv_bias is None else config.qkv_bias
    return replace(config, num_kv_heads=config.num_kv_heads or config.num_heads, qkv_bias=qkv_bias)


def _text_ids(length: int = 48) -> torch.Tensor:
    return torch.tensor([TOKENIZER.encode(TEXT[:length]), TOKENIZER.encode(TEXT[60 : 60 + length])])


@pytest.mark.parametrize("shape", FAMILY_SHAPES)
def test_each_family_loads_in_transformers_with_qkvs_logits_and_reads_back(shape, tmp_path):
    family, change = FAMILY_SHAPES[shape]
    model = _model(**change)
    assert export_causal_lm(model, TOKENIZER, tmp_path / "hf") == family
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["model_type"] == family and config["architectures"] == [HF_CLASSES[family]]
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(hf).__name__ == HF_CLASSES[family]
    ids = _text_ids()  # 48 tokens: past every window
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=ids).logits, model(ids).logits, atol=1e-5, rtol=0)
    back = load_pretrained(tmp_path / "hf", device="cpu")
    assert back.config == _same_function_config(model.config)
    ours, theirs = model.state_dict(), back.state_dict()
    assert set(theirs) == set(ours) and all(torch.equal(theirs[k], ours[k]) for k in ours)
    assert back.tokenizer.encode(TEXT) == TOKENIZER.encode(TEXT)
    # transformers 5's AutoTokenizer forces its Qwen2Tokenizer (a byte-level pre-tokenizer of its own) on
    # every qwen2 folder; the folder's tokenizer.json itself encodes as the run did
    hf_tokenizer = (PreTrainedTokenizerFast if family == "qwen2" else AutoTokenizer).from_pretrained(tmp_path / "hf")
    assert hf_tokenizer(TEXT[:30]).input_ids == TOKENIZER.encode(TEXT[:30])


def test_a_bpe_tokenizer_goes_with_the_folder(tmp_path):
    tokenizer = Tokenizer.load(FIXTURES / "translation_run" / "tokenizer.json")
    model = _model(vocab_size=300, num_kv_heads=2)
    assert export_causal_lm(model, tokenizer, tmp_path / "hf") == "llama"
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["eos_token_id"] == tokenizer.eos_id and config["bos_token_id"] == tokenizer.eos_id
    back = load_pretrained(tmp_path / "hf", device="cpu")
    text = "Zwei Hunde spielen im Schnee."
    assert back.tokenizer.encode(text) == tokenizer.encode(text)
    assert AutoTokenizer.from_pretrained(tmp_path / "hf")(text).input_ids == tokenizer.encode(text)


def test_a_gpt2_shaped_model_still_exports_as_gpt2(tmp_path):
    model = _model(norm="layer", activation="gelu_tanh", positional="learned", bias=True, tie_output=True)
    assert export_causal_lm(model, TOKENIZER, tmp_path / "hf") == "gpt2"
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == "gpt2"


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"qk_norm": True}, "qk_norm"),
        ({"logit_softcap": 30.0}, "logit_softcap"),
        ({"rotary_fraction": 0.5}, "rotary_fraction"),
        ({"activation": "relu2"}, "activation"),
        ({"scale_embedding": True}, "scale_embedding"),
        ({"norm_first": False}, "norm_first"),
        ({"positional": "alibi"}, "positional"),
        ({"bias": True, "qkv_bias": False}, "qkv_bias"),
        ({"bias": True, "sliding_window": 4}, "bias"),
        ({"sliding_window": 4, "sliding_window_layers": [0]}, "sliding_window_layers"),
    ],
)
def test_shapes_no_family_holds_are_refused_naming_the_field(change, field, tmp_path):
    config = CausalLMConfig(**{**LLAMA, **change})
    reason = lm_refusal(config)
    assert reason is not None and reason.startswith("cannot export to Llama/Mistral/Qwen2: " + field)
    assert "\n" not in reason
    with pytest.raises(ValueError, match=field):
        build_llama_model(CausalLM(config), TOKENIZER)
    with pytest.raises(ValueError, match=field):
        export_causal_lm(CausalLM(config), TOKENIZER, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_a_refusal_names_the_closer_family():
    gpt2_like = CausalLMConfig(**{**LLAMA, "norm": "layer", "activation": "gelu", "positional": "sinusoidal"})
    assert lm_refusal(gpt2_like) == "cannot export to GPT-2: positional='sinusoidal': GPT-2 has learned positions only"
    assert llama_refusal(gpt2_like) is not None
    assert lm_refusal(CausalLMConfig(**{**LLAMA, "norm": "layer"})).startswith(
        "cannot export to Llama/Mistral/Qwen2: norm='layer'"
    )


CT2_SHAPES = {
    "llama-gqa": dict(num_kv_heads=2),
    "mistral-window": dict(sliding_window=5, num_kv_heads=2),
    "qwen2-window-on-some-layers": dict(qkv_bias=True, sliding_window=4, sliding_window_layers=[1, 2]),
    "biases-tied-geglu-linear-scaling": dict(
        bias=True, tie_output=True, activation="geglu", rotary_scaling="linear", rotary_scaling_factor=2.0
    ),
    "partial-rotary-qk-norm-softcap": dict(rotary_fraction=0.5, qk_norm=True, logit_softcap=5.0),
    "alibi-multi-query": dict(positional="alibi", num_kv_heads=1),
    "post-ln-sinusoidal-layernorm-qk-norm": dict(
        norm="layer", qk_norm=True, norm_first=False, positional="sinusoidal", scale_embedding=True, activation="relu"
    ),
    "gpt2-learned": dict(norm="layer", activation="gelu_tanh", positional="learned", bias=True),
}


def _clear_prompts(model: CausalLM, length: int, new: int, count: int = 200) -> tuple[list, list]:
    """``count`` distinct prompts of ``length`` tokens and qkv's greedy continuations of ``new`` tokens,
    among those none of whose steps is a near-tie (two best logits within TIE_MARGIN: another library's
    rounding may break a tie the other way without the models differing)."""
    generator = torch.Generator().manual_seed(length)
    candidates = torch.randint(0, model.config.vocab_size, (2 * count, length), generator=generator).unique(dim=0)
    candidates = candidates[torch.randperm(len(candidates), generator=generator)]
    with torch.no_grad():
        full = model.generate(candidates, new, temperature=0)
        best = model(full[:, :-1]).logits[:, length - 1 :].topk(2, dim=-1).values  # (c, new, 2): each step's
    clear = ((best[..., 0] - best[..., 1]) > TIE_MARGIN).all(dim=1)
    assert int(clear.sum()) >= count, f"only {int(clear.sum())} of {len(candidates)} prompts without a near-tie"
    return candidates[clear][:count].tolist(), full[clear][:count, length:].tolist()


@pytest.mark.parametrize("shape", CT2_SHAPES)
def test_ctranslate2_greedy_generation_is_qkvs_on_200_prompts(shape, tmp_path):
    model = _model(0.3, **CT2_SHAPES[shape])
    tokens = write_lm_model(model, TOKENIZER, tmp_path)
    assert check_lm_folder(model, tokens, tmp_path, quantization="float32") < 1e-4
    generator = ctranslate2.Generator(str(tmp_path), device="cpu")
    new = 16
    for length in (2, 3, 8):  # prompts shorter and longer than the windows; prompt + new within the context
        prompts, expected = _clear_prompts(model, length, new)
        assert generate_greedy(generator, tokens, prompts, new) == expected


def test_ctranslate2_with_a_bpe_vocabulary_does_not_stop_at_eos(tmp_path):
    tokenizer = Tokenizer.load(FIXTURES / "translation_run" / "tokenizer.json")
    model = _model(0.3, vocab_size=300, num_kv_heads=2)
    with torch.no_grad():
        model.output_proj.weight[tokenizer.eos_id] += 0.5  # EOS comes up often: CTranslate2 must go on
    tokens = write_lm_model(model, tokenizer, tmp_path)
    assert tokens[tokenizer.eos_id] == "</s>" and len(tokens) == 300
    check_lm_folder(model, tokens, tmp_path, quantization="float32")
    generator = ctranslate2.Generator(str(tmp_path), device="cpu")
    prompts = [tokenizer.encode(text) for text in ("Zwei Hunde", "Ein Mann liest", "A")]
    for prompt in prompts:
        expected = model.generate(torch.tensor([prompt]), 20, temperature=0)[0, len(prompt) :].tolist()
        assert generate_greedy(generator, tokens, [prompt], 20) == [expected]


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"activation": "relu2"}, "activation"),
        ({"rotary_scaling": "llama3", "rotary_scaling_factor": 4.0, "rotary_original_context": 16}, "rotary_scaling"),
    ],
)
def test_ctranslate2_refuses_what_it_cannot_compute(change, field, tmp_path):
    config = CausalLMConfig(**{**LLAMA, **change})
    reason = ct2_lm_refusal(config)
    assert reason is not None and reason.startswith(field) and "\n" not in reason
    with pytest.raises(ValueError, match=f"cannot export to CTranslate2: {field}"):
        write_lm_model(CausalLM(config), TOKENIZER, tmp_path)


@pytest.fixture(scope="module")
def llama_run(tmp_path_factory):
    """A Llama-shaped character language model trained for 2 steps by ``qkv train`` (its model options
    from a recipe file), exported through the CLI to both formats."""
    root = tmp_path_factory.mktemp("llama_run")
    (root / "train.txt").write_text(TEXT * 8, encoding="utf-8")
    model_table = "\n".join(
        f"{key} = {json.dumps(value)}" for key, value in {**LLAMA, "num_kv_heads": 2}.items() if key != "vocab_size"
    )
    (root / "llama.toml").write_text(
        'description = "a tiny Llama-shaped language model"\ntask = "lm"\nvocab_size = 300\n\n'
        f'[lm]\ntokenizer = "char"\n\n[model]\n{model_table}\n\n[train]\nmax_tokens = 256\nwarmup_steps = 2\n',
        encoding="utf-8",
    )
    run_dir = root / "run"
    options = ["--task", "lm", "--train-text", str(root / "train.txt"), "--recipe", str(root / "llama.toml")]
    options += ["--max-steps", "2", "--minutes", "0", "--no-bf16", "--no-progress", "--threads", "1"]
    assert main(["train", *options, "--run-dir", str(run_dir)]) == 0
    assert main(["export", str(run_dir), "--to", "hf", str(root / "hf")]) == 0
    assert main(["export", str(run_dir), "--to", "ctranslate2", str(root / "ct2")]) == 0
    return run_dir, root / "hf", root / "ct2"


def test_the_cli_exports_a_llama_run_to_transformers(llama_run):
    run_dir, folder, _ = llama_run
    model, tokenizer, _ = load_run(run_dir)
    assert model.config.norm == "rms" and model.config.num_kv_heads == 2  # the recipe's shape
    hf = AutoModelForCausalLM.from_pretrained(folder).eval()
    assert type(hf).__name__ == "LlamaForCausalLM"
    ids = torch.tensor([tokenizer.encode(TEXT[:60])])
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=ids).logits, model(ids).logits, atol=1e-5, rtol=0)
    back = load_pretrained(folder, device="cpu")
    assert all(torch.equal(back.state_dict()[k], v) for k, v in model.state_dict().items())
    assert json.loads((folder / ".qkv-export.json").read_text())["qkv_export"] == "hf"


def test_the_cli_exports_a_llama_run_to_ctranslate2(llama_run, tmp_path, capsys):
    run_dir, _, folder = llama_run
    model, tokenizer, _ = load_run(run_dir)
    assert json.loads((folder / MANIFEST).read_text())["tokenizer"] == "char"
    assert (folder / "tokenizer.json").is_file() and (folder / "model.bin").is_file()
    tokens = json.loads((folder / "vocabulary.json").read_text())
    generator = ctranslate2.Generator(str(folder), device="cpu")
    prompts = [tokenizer.encode(text) for text in ("First", "All: S", "You are all")]
    for prompt in prompts:  # a model trained 2 steps is close to uniform: a near-tie may part them
        expected = model.generate(torch.tensor([prompt]), 24, temperature=0)[0, len(prompt) :].tolist()
        assert same_up_to_ties(model, prompt, expected, generate_greedy(generator, tokens, [prompt], 24)[0])
    # a shape CTranslate2 cannot compute: refused in one line, exit code 2, nothing written
    config = json.loads((run_dir / "config.json").read_text())
    config["model"].update(rotary_scaling="llama3", rotary_scaling_factor=4.0, rotary_original_context=16)
    other = tmp_path / "llama3"
    other.mkdir()
    for name in ("tokenizer.json", "model.safetensors"):
        (other / name).write_bytes((run_dir / name).read_bytes())
    (other / "config.json").write_text(json.dumps(config))
    capsys.readouterr()
    assert main(["export", str(other), "--to", "ctranslate2", str(tmp_path / "out")]) == 2
    error = capsys.readouterr().err.strip()
    assert "rotary_scaling='llama3'" in error and "\n" not in error and not (tmp_path / "out").exists()
