"""qkv reads back the Hugging Face folders ``qkv export --to hf`` writes: a Marian folder becomes the
run's Transformer and tokenizer again, a GPT-2 folder the run's language model and tokenizer class,
and ``qkv attend`` / ``qkv generate`` on a folder give what they give on the run. Each loaded model is
also checked against ``transformers`` running the same folder (the independent reference)."""

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from transformers import GPT2LMHeadModel, MarianMTModel  # noqa: E402

from qkv.cli import main  # noqa: E402
from qkv.data.batching import pad_sequences  # noqa: E402
from qkv.data.dates import generate_dates  # noqa: E402
from qkv.data.text import CharTokenizer  # noqa: E402
from qkv.data.tokenizer import Tokenizer  # noqa: E402
from qkv.decoding.translate import translate_texts  # noqa: E402
from qkv.export.hf_gpt2 import export_language_model  # noqa: E402
from qkv.export.huggingface import export_translation  # noqa: E402
from qkv.models.causal_lm import CausalLM, CausalLMConfig  # noqa: E402
from qkv.models.transformer import Transformer  # noqa: E402
from qkv.pretrained import PretrainedTransformer, load_pretrained  # noqa: E402
from qkv.pretrained.gpt2 import load_gpt2  # noqa: E402
from qkv.pretrained.marian import load_marian  # noqa: E402
from qkv.runs.folder import load_run  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures" / "runs_v0_1"


@pytest.fixture(scope="module")
def dates(tmp_path_factory):
    """A post-LN GELU date model trained for 150 steps, and its export (through the CLI)."""
    root = tmp_path_factory.mktemp("dates")
    run_dir = root / "run"
    options = ["--d-model", "32", "--heads", "2", "--encoder-layers", "1", "--decoder-layers", "1", "--d-ff", "64"]
    options += ["--no-norm-first", "--activation", "gelu", "--max-tokens", "800", "--no-progress", "--threads", "1"]
    budget = ["--max-steps", "150", "--minutes", "0", "--eval-every-steps", "0"]
    assert main(["train", "--data", "dates", "--run-dir", str(run_dir), *budget, *options]) == 0
    assert main(["export", str(run_dir), "--to", "hf", str(root / "hf")]) == 0
    return run_dir, root / "hf", generate_dates(12, seed=5, split="test")


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    """The 0.1.0 character language-model fixture (pre-LN, learned positions) and its export."""
    root = tmp_path_factory.mktemp("lm")
    run_dir = root / "run"
    shutil.copytree(FIXTURES / "lm_run", run_dir)
    assert main(["export", str(run_dir), "--to", "hf", str(root / "hf")]) == 0
    return run_dir, root / "hf"


def _teacher_forced(tokenizer, pairs):
    src = pad_sequences([tokenizer.encode(t) + [tokenizer.eos_id] for t in pairs.src], 0)
    tgt = pad_sequences([[tokenizer.bos_id] + tokenizer.encode(t) for t in pairs.tgt], 0)
    return src, tgt


def test_marian_folder_loads_back_as_the_runs_transformer(dates):
    run_dir, folder, pairs = dates
    model, tokenizer, _ = load_run(run_dir)
    loaded = load_pretrained(folder, device="cpu")
    assert isinstance(loaded, PretrainedTransformer) and isinstance(loaded.tokenizer, Tokenizer)
    assert loaded.config == replace(model.config, dropout=loaded.config.dropout)  # dropout: the run trains with its own
    for text in [*pairs.src, "a <s> typed as text"]:
        assert loaded.tokenizer.encode(text) == tokenizer.encode(text)
    src, tgt = _teacher_forced(tokenizer, pairs)
    hf = MarianMTModel.from_pretrained(folder).eval()
    with torch.no_grad():
        ours, back = model(src, tgt), loaded(src, tgt)
        theirs = hf(input_ids=src, attention_mask=src != 0, decoder_input_ids=tgt).logits
    real = tgt != 0
    torch.testing.assert_close(back[real], ours[real], atol=1e-5, rtol=0)
    torch.testing.assert_close(back[real], theirs[real], atol=1e-5, rtol=0)
    texts = list(pairs.src)
    for beam in (1, 4):
        assert translate_texts(loaded, loaded.tokenizer, texts, beam_size=beam) == translate_texts(
            model, tokenizer, texts, beam_size=beam
        )


@pytest.mark.parametrize(
    "change",
    [
        {"share_embeddings": False},
        {"tie_output": False},
        {"share_embeddings": False, "tie_output": False},
        {"bias": False},
    ],
)
def test_marian_variants_load_back(tmp_path, change):
    """Sharing, tying and biases change which tensors a folder holds; each reads back exactly."""
    run_dir = FIXTURES / "translation_run"
    base, tokenizer, config = load_run(run_dir)
    torch.manual_seed(0)
    model = Transformer(replace(base.config, **change)).eval()
    export_translation(model, tokenizer, config, tmp_path / "hf")
    loaded, loaded_tokenizer = load_marian(tmp_path / "hf", device="cpu")
    src = pad_sequences([tokenizer.encode(t) + [2] for t in ["Two dogs play.", "A man reads a book on a bench."]], 0)
    tgt = pad_sequences([[1] + tokenizer.encode(t) for t in ["Zwei Hunde spielen.", "Ein Mann liest."]], 0)
    with torch.no_grad():
        torch.testing.assert_close(loaded(src, tgt)[tgt != 0], model(src, tgt)[tgt != 0], atol=1e-5, rtol=0)


def _edit_config(folder: Path, **fields) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.update(fields)
    (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"decoder_start_token_id": 0}, "decoder_start_token_id"),
        ({"scale_embedding": False}, "scale_embedding"),
        ({"activation_function": "swish"}, "activation_function"),
        ({"decoder_ffn_dim": 128}, "decoder_ffn_dim"),
    ],
)
def test_marian_folders_qkv_cannot_read_are_refused_in_one_line(dates, tmp_path, capsys, fields, named):
    _, folder, _ = dates
    copy = tmp_path / "hf"
    shutil.copytree(folder, copy)
    _edit_config(copy, **fields)
    with pytest.raises(ValueError, match=named):
        load_marian(copy, device="cpu")
    assert main(["attend", "3 March 1999", "--model", str(copy), "-o", str(tmp_path / "a.html")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and named in err


def test_a_logits_bias_is_refused(dates, tmp_path):
    from safetensors.torch import load_file, save_file

    _, folder, _ = dates
    copy = tmp_path / "hf"
    shutil.copytree(folder, copy)
    state = load_file(str(copy / "model.safetensors"))
    state["final_logits_bias"] = torch.full_like(state["final_logits_bias"], 0.5)
    save_file(state, str(copy / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="final_logits_bias"):
        load_marian(copy, device="cpu")


def _attend_json(model: Path, out: Path, *args: str) -> dict:
    assert main(["attend", *args, "--model", str(model), "-o", str(out / "a.html"), "--json", str(out / "a.json")]) == 0
    return json.loads((out / "a.json").read_text())


def _same_views(a: dict, b: dict) -> None:
    assert len(a["examples"]) == len(b["examples"])
    for x, y in zip(a["examples"], b["examples"]):
        assert x["text"] == y["text"] and x["output"] == y["output"]
        assert [v["name"] for v in x["views"]] == [v["name"] for v in y["views"]]
        for v, w in zip(x["views"], y["views"]):
            assert v["queries"] == w["queries"] and v["keys"] == w["keys"]
            torch.testing.assert_close(torch.tensor(v["attention"]), torch.tensor(w["attention"]), atol=1e-5, rtol=0)


def test_attend_reads_a_marian_folder_as_its_run(dates, tmp_path):
    run_dir, folder, pairs = dates
    (tmp_path / "run").mkdir()
    (tmp_path / "hf").mkdir()
    source, target = pairs.src[0], pairs.tgt[0]
    forced = ("--target", target, "--target", "1999-01-01")
    ours = _attend_json(run_dir, tmp_path / "run", source, pairs.src[1], *forced)
    back = _attend_json(folder, tmp_path / "hf", source, pairs.src[1], *forced)
    assert [v["name"] for v in back["examples"][0]["views"]] == [
        "encoder self-attention",
        "decoder self-attention",
        "cross-attention",
    ]
    _same_views(back, ours)
    greedy_run = _attend_json(run_dir, tmp_path / "run", source)  # no target: the model's own translation
    greedy_back = _attend_json(folder, tmp_path / "hf", source)
    _same_views(greedy_back, greedy_run)


def test_gpt2_folder_loads_back_with_the_runs_tokenizer_and_logits(lm):
    run_dir, folder = lm
    model, tokenizer, _ = load_run(run_dir)
    loaded, loaded_tokenizer = load_gpt2(folder, device="cpu")
    assert isinstance(loaded_tokenizer, CharTokenizer) and loaded_tokenizer.chars == tokenizer.chars
    text = "ROMEO:\nWhat say you, my lord?\n"
    ids = torch.tensor([tokenizer.encode(text)])
    hf = GPT2LMHeadModel.from_pretrained(folder).eval()
    with torch.no_grad():
        back = loaded(ids).logits
        torch.testing.assert_close(back, model(ids).logits, atol=1e-5, rtol=0)
        torch.testing.assert_close(back, hf(input_ids=ids).logits, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="not in the model's vocabulary"):
        loaded_tokenizer.encode("\u4e2d")  # as the run's tokenizer: an unseen character is refused


def test_generate_on_a_gpt2_folder_prints_the_runs_greedy_text(lm, capsys):
    run_dir, folder = lm
    outputs = []
    for model in (run_dir, folder):
        args = ["generate", str(model), "--prompt", "ROMEO:", "--temperature", "0", "--max-new-tokens", "60"]
        assert main([*args, "--device", "cpu"]) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1] and len(outputs[0]) > len("ROMEO:") + 30
    hf = GPT2LMHeadModel.from_pretrained(folder).eval()  # and transformers' greedy continuation is the same
    tokenizer = load_gpt2(folder, device="cpu")[1]
    ids = torch.tensor([tokenizer.encode("ROMEO:")])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=20, pad_token_id=0)
    assert outputs[1].startswith(tokenizer.decode(out[0].tolist()))


def test_attend_reads_a_gpt2_folder_as_its_run(lm, tmp_path):
    run_dir, folder = lm
    (tmp_path / "run").mkdir()
    (tmp_path / "hf").mkdir()
    ours = _attend_json(run_dir, tmp_path / "run", "ROMEO: What say you?")
    back = _attend_json(folder, tmp_path / "hf", "ROMEO: What say you?")
    _same_views(back, ours)


def test_generate_refuses_a_marian_folder_in_one_line(dates, capsys):
    _, folder, _ = dates
    assert main(["generate", str(folder), "--prompt", "1999", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "not a language model" in err


def test_bpe_language_model_folder_reads_back_with_qkvs_tokenizer(tmp_path):
    """A BPE language model's folder gives qkv's Tokenizer back (special ids are not printed), and
    the same greedy continuation."""
    tokenizer = Tokenizer.load(FIXTURES / "translation_run" / "tokenizer.json")
    config = CausalLMConfig(vocab_size=300, d_model=16, num_heads=2, num_layers=2, d_ff=32, context=32)
    torch.manual_seed(0)
    model = CausalLM(config).eval()
    export_language_model(model, tokenizer, tmp_path / "hf")
    loaded, loaded_tokenizer = load_gpt2(tmp_path / "hf", device="cpu")
    assert isinstance(loaded_tokenizer, Tokenizer)
    ids = torch.tensor([tokenizer.encode("Zwei Hunde spielen im Schnee.")])
    torch.testing.assert_close(loaded.generate(ids, 20, temperature=0), model.generate(ids, 20, temperature=0))
    assert loaded_tokenizer.decode([1, *ids[0].tolist(), 2]) == tokenizer.decode([1, *ids[0].tolist(), 2])


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        # within qkv's size bounds (qkv.runtime.limits) but beyond what the weights hold
        ({"encoder_layers": 1000}, "encoder_layers is 1000"),
        ({"decoder_layers": 1000}, "decoder_layers is 1000"),
        # beyond the bounds: refused by the config's own check, naming the file and the field
        ({"max_position_embeddings": 10**9}, "config.json: max_len must be at most"),
        ({"decoder_layers": 10**6}, "config.json: num_decoder_layers must be at most"),
    ],
)
def test_a_marian_config_asking_for_more_than_its_weights_is_refused_before_building(dates, tmp_path, fields, named):
    """A config.json from someone else cannot make qkv build (allocate) what the weights cannot fill:
    the check runs on the meta device, so this fails fast instead of exhausting memory."""
    _, folder, _ = dates
    copy = tmp_path / "hf"
    shutil.copytree(folder, copy)
    _edit_config(copy, **fields)
    with pytest.raises(ValueError, match=named) as refused:
        load_marian(copy, device="cpu")
    assert len(str(refused.value).splitlines()) == 1
