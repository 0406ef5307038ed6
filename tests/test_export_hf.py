"""``qkv export RUN --to hf OUT``: the exported folders load with ``transformers`` and compute what the
run's qkv model computes (teacher-forced logits, greedy translations), their tokenizers encode as qkv's,
and configurations without an exact counterpart are refused with a one-line reason."""

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from transformers import AutoTokenizer, GPT2LMHeadModel, MarianMTModel  # noqa: E402

from qkv.cli import main  # noqa: E402
from qkv.data.batching import pad_sequences  # noqa: E402
from qkv.data.dates import generate_dates  # noqa: E402
from qkv.data.tokenizer import Tokenizer  # noqa: E402
from qkv.decoding.search import beam_search, greedy_decode  # noqa: E402
from qkv.decoding.translate import translate_texts  # noqa: E402
from qkv.export.hf_gpt2 import build_gpt2_model, export_language_model  # noqa: E402
from qkv.export.huggingface import build_marian, export_translation, residual_permutation  # noqa: E402
from qkv.models.causal_lm import CausalLM, CausalLMConfig  # noqa: E402
from qkv.models.transformer import Transformer  # noqa: E402
from qkv.nn.positional import sinusoidal_table  # noqa: E402
from qkv.runs.folder import load_run  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures" / "runs_v0_1"
SENTENCES = [
    "A man is riding a bicycle down the street.",
    "Two dogs play in the snow.",
    "A woman in a red dress sings on a stage.",
    "Children are playing soccer in a park.",
    "An old man reads a newspaper on a bench.",
    "A group of people stand outside a building.",
    "The girl is jumping into a swimming pool.",
    "A chef prepares food in a busy kitchen.",
    "Three men are working on a roof.",
    "A black cat sleeps on the windowsill.",
    "People walk along the beach at sunset.",
    "A boy throws a ball to his father.",
    "Two women are talking at a cafe.",
    "A musician plays guitar in the subway.",
    "The team celebrates after winning the game.",
    "A small child eats an ice cream cone.",
    "Workers repair the road in the rain.",
    "A man climbs a steep rock wall.",
    "Tourists take pictures of the old church.",
    "A dog runs through a field of flowers.",
]
GERMAN = ["Ein Mann fährt Fahrrad.", "Zwei Hunde spielen im Schnee.", "Eine Frau singt auf einer Bühne."]


@pytest.fixture(scope="module")
def dates_export(tmp_path_factory):
    """A post-LN GELU date model trained for 150 steps (its translations are partly right: varied
    outputs that end with EOS), exported through the CLI."""
    root = tmp_path_factory.mktemp("dates")
    run_dir = root / "run"
    options = ["--d-model", "32", "--heads", "2", "--encoder-layers", "1", "--decoder-layers", "1", "--d-ff", "64"]
    options += ["--no-norm-first", "--activation", "gelu", "--max-tokens", "800", "--no-progress", "--threads", "1"]
    budget = ["--max-steps", "150", "--minutes", "0", "--eval-every-steps", "0"]
    assert main(["train", "--data", "dates", "--run-dir", str(run_dir), *budget, *options]) == 0
    assert main(["export", str(run_dir), "--to", "hf", str(root / "hf")]) == 0
    model, tokenizer, _ = load_run(run_dir)
    return model, tokenizer, generate_dates(20, seed=3, split="test"), root / "hf"


def test_export_is_marked_and_readable_by_all(dates_export):
    """Every file of the folder is 0644 (model.safetensors too, which safetensors creates 0600) and
    ``.qkv-export.json`` lists exactly the others: what a later ``--overwrite`` may delete."""
    import stat

    folder = dates_export[3]
    marker = json.loads((folder / ".qkv-export.json").read_text())
    assert marker["qkv_export"] == "hf"
    assert sorted(p.name for p in folder.iterdir() if p.name != ".qkv-export.json") == marker["files"]
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(marker["files"])
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in folder.iterdir()} == dict.fromkeys(
        [*marker["files"], ".qkv-export.json"], 0o644
    )


@pytest.fixture(scope="module")
def translation_export(tmp_path_factory):
    """The 0.1.0 translation fixture (post-LN, GELU, shared embeddings) exported through the CLI."""
    root = tmp_path_factory.mktemp("export")
    run_dir = root / "run"
    shutil.copytree(FIXTURES / "translation_run", run_dir)
    assert main(["export", str(run_dir), "--to", "hf", str(root / "hf")]) == 0
    model, tokenizer, config = load_run(run_dir)
    return model, tokenizer, config, root / "hf"


def _sources(tokenizer, texts):
    return pad_sequences([tokenizer.encode(t) + [tokenizer.eos_id] for t in texts], 0)


def test_marian_sinusoids_are_qkv_sinusoids_permuted():
    """The premise of the export: Marian's table (sines first, then cosines) is qkv's interleaved
    table with its dimensions reordered by residual_permutation."""
    from transformers.models.marian.modeling_marian import MarianSinusoidalPositionalEmbedding

    table = MarianSinusoidalPositionalEmbedding(50, 12).create_weight()
    ours = sinusoidal_table(50, 12)
    assert not torch.allclose(table, ours, atol=1e-3)  # the layouts do differ
    torch.testing.assert_close(table, ours[:, residual_permutation(12)], atol=1e-6, rtol=0)


def test_marian_logits_equal_qkv_logits_teacher_forced(dates_export):
    model, tokenizer, pairs, folder = dates_export
    hf = MarianMTModel.from_pretrained(folder).eval()
    src = _sources(tokenizer, pairs.src)
    tgt = pad_sequences([[tokenizer.bos_id] + tokenizer.encode(t) for t in pairs.tgt], 0)
    with torch.no_grad():
        ours = model(src, tgt)
        theirs = hf(input_ids=src, attention_mask=src != 0, decoder_input_ids=tgt).logits
    real = tgt != 0  # padded target positions compute garbage on both sides
    # 1e-5, plus 1e-5 of the logit's size: Marian's residual dimensions are qkv's permuted, so every product
    # sums in another order; on an AVX512 EPYC one logit of 1.5 differed by 1.4e-5 (9.5e-6 of it)
    torch.testing.assert_close(theirs[real], ours[real], atol=1e-5, rtol=1e-5)


def test_marian_greedy_generate_equals_qkv_greedy_decode(dates_export):
    model, tokenizer, pairs, folder = dates_export
    hf = MarianMTModel.from_pretrained(folder).eval()
    src = _sources(tokenizer, pairs.src)
    ours = greedy_decode(model, src, bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id)
    assert len({tuple(t) for t in ours}) > 10 and all(0 < len(t) < 20 for t in ours)  # a model that says things
    for i, row in enumerate(src):
        ids = row[row != 0][None]
        # qkv stops a sentence after min(source length + 50, max_len - 1) tokens; HF has one limit per call
        limit = min(ids.size(1) + 50, model.config.max_len - 1)
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), num_beams=1, max_new_tokens=limit)
        tokens = out[0, 1:].tolist()  # drop the decoder start (BOS)
        assert tokens[-1] == tokenizer.eos_id, pairs.src[i]
        assert tokens[:-1] == ours[i], pairs.src[i]
    batch = hf.generate(src, attention_mask=src != 0, num_beams=1)  # padded together, as qkv decodes
    for i, row in enumerate(batch.tolist()):
        assert row[1 : 1 + len(ours[i]) + 1] == [*ours[i], tokenizer.eos_id]


def _generated(row: list[int], eos_id: int) -> list[int]:
    """A ``generate`` row without its decoder start, its fill and its EOS. (A hypothesis cut at the
    length limit has no EOS; transformers fills rows with the EOS id when the pad id is 0.)"""
    row = row[1:]
    while row and row[-1] in (0, eos_id):
        row = row[:-1]
    return row


def _beam_parity(model, tokenizer, hf, texts, beam, alpha, **hf_settings):
    """The sentences of ``texts`` on which qkv's beam search with the "power" penalty and
    Hugging Face's ``generate`` disagree, and qkv's best hypotheses."""
    differ, ours_all = [], []
    for text in texts:
        ids = torch.tensor([tokenizer.encode(text) + [tokenizer.eos_id]])
        ours = beam_search(
            model, ids, bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id, beam_size=beam, alpha=alpha, penalty="power"
        )[0]
        # qkv stops a sentence after min(source length + 50, max_len - 1) tokens; HF has one limit per call
        limit = min(ids.size(1) + 50, model.config.max_len - 1)
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=limit, **hf_settings)
        ours_all.append(ours)
        if _generated(out[0].tolist(), tokenizer.eos_id) != ours:
            differ.append(text)
    return differ, ours_all


def test_marian_beam_search_without_length_penalty_equals_qkvs(dates_export):
    """With alpha 0 both rank by the summed log-probability, keep 2k candidates a step and stop at k
    finished hypotheses (early_stopping): the same search, whatever qkv's penalty form."""
    model, tokenizer, pairs, folder = dates_export
    hf = MarianMTModel.from_pretrained(folder).eval()
    for text in pairs.src:
        ids = torch.tensor([tokenizer.encode(text) + [tokenizer.eos_id]])
        ours = beam_search(model, ids, bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id, beam_size=4, alpha=0.0)[0]
        limit = min(ids.size(1) + 50, model.config.max_len - 1)
        with torch.no_grad():
            out = hf.generate(ids, num_beams=4, length_penalty=0.0, early_stopping=True, max_new_tokens=limit)
        assert out[0, 1:].tolist() == [*ours, tokenizer.eos_id], text


@pytest.mark.parametrize(("beam", "alpha"), [(4, 0.6), (4, 1.0), (5, 0.6), (5, 1.0)])
def test_marian_beam_search_with_length_penalty_equals_qkvs_power_form(dates_export, beam, alpha):
    """Hugging Face divides a finished hypothesis's log-probability by len ** length_penalty (len
    counting EOS, not the decoder start): qkv's penalty="power". The exported generation_config
    carries the run's beam size (5) and alpha (0.6) with early_stopping, so a bare ``generate``
    is the run's beam search."""
    model, tokenizer, pairs, folder = dates_export
    hf = MarianMTModel.from_pretrained(folder).eval()
    if (beam, alpha) == (5, 0.6):  # the run's own settings: generation_config.json's
        assert (hf.generation_config.num_beams, hf.generation_config.length_penalty) == (beam, alpha)
        assert hf.generation_config.early_stopping is True
        settings = {}
    else:
        settings = dict(num_beams=beam, length_penalty=alpha, early_stopping=True)
    differ, _ = _beam_parity(model, tokenizer, hf, pairs.src, beam, alpha, **settings)
    assert differ == []


@pytest.mark.parametrize(("beam", "alpha"), [(4, 0.6), (4, 1.0), (5, 0.6), (5, 1.0)])
def test_power_form_ranks_as_hugging_face_where_the_length_penalty_decides(translation_export, beam, alpha):
    """The date model's translations are all about 10 tokens long, so the length penalty rarely
    changes a winner there. This model (the fixture with its EOS embedding doubled) ends its
    hypotheses anywhere from 6 tokens to the limit: at alpha 1.0 the penalty and its form change
    most winners, and Hugging Face still picks qkv's "power" winner on every sentence."""
    base, tokenizer, _, _ = translation_export
    model = Transformer(base.config).eval()
    model.load_state_dict(base.state_dict())
    with torch.no_grad():
        model.src_embed.embedding.weight[tokenizer.eos_id] *= 2.0  # shared and tied: EOS becomes likelier
    hf = build_marian(model, tokenizer)
    settings = dict(num_beams=beam, length_penalty=alpha, early_stopping=True)
    settings.update(decoder_start_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id, pad_token_id=0)
    differ, power = _beam_parity(model, tokenizer, hf, SENTENCES, beam, alpha, **settings)
    ids = [torch.tensor([tokenizer.encode(t) + [tokenizer.eos_id]]) for t in SENTENCES]
    special = dict(bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id, beam_size=beam)
    assert len({len(t) for t in power}) >= 5
    if alpha == 1.0:  # (at 0.6 this model's winners are those of alpha 0)
        raw = [beam_search(model, x, alpha=0.0, **special)[0] for x in ids]
        gnmt = [beam_search(model, x, alpha=alpha, penalty="gnmt", **special)[0] for x in ids]
        assert sum(a != b for a, b in zip(raw, power)) >= 5  # the penalty decides here
        assert sum(a != b for a, b in zip(gnmt, power)) >= 5  # and so does its form
    assert differ == []


def test_translating_with_generate_as_the_docs_say_gives_qkvs_power_beam_translations(dates_export):
    """transformers 5 has no translation pipeline; the documented recipe (AutoTokenizer, a padded
    batch, ``generate`` with the exported generation_config, ``batch_decode``) gives what
    ``translate_texts(..., penalty="power")`` gives with the run's beam size and alpha."""
    import transformers
    from transformers import AutoModelForSeq2SeqLM

    model, tokenizer, pairs, folder = dates_export
    hf_tokenizer = AutoTokenizer.from_pretrained(folder)
    hf = AutoModelForSeq2SeqLM.from_pretrained(folder).eval()
    texts = list(pairs.src)
    batch = hf_tokenizer(texts, return_tensors="pt", padding=True)
    with torch.no_grad():
        out = hf.generate(**batch)  # num_beams 5, length_penalty 0.6, early_stopping: the run's
    theirs = hf_tokenizer.batch_decode(out, skip_special_tokens=True)
    ours = translate_texts(model, tokenizer, texts, beam_size=5, alpha=0.6, penalty="power")
    assert theirs == ours
    if int(transformers.__version__.split(".")[0]) >= 5:
        with pytest.raises(KeyError, match="removed"):
            transformers.pipeline("translation", model=str(folder))


def test_gpt2_folder_works_in_the_text_generation_pipeline(tmp_path, capsys):
    """The exported GPT-2 folder in transformers' text-generation pipeline, greedy, continues a
    prompt as ``qkv generate --temperature 0`` does on the run (within the context of 32 positions:
    past it qkv slides its window, GPT-2 has no position left)."""
    from transformers import pipeline

    run_dir = tmp_path / "run"
    shutil.copytree(FIXTURES / "lm_run", run_dir)
    assert main(["export", str(run_dir), "--to", "hf", str(tmp_path / "hf")]) == 0
    capsys.readouterr()
    generate = ["--prompt", "ROMEO:", "--temperature", "0", "--max-new-tokens", "26", "--device", "cpu"]
    assert main(["generate", str(run_dir), *generate]) == 0
    ours = capsys.readouterr().out.rstrip("\n")
    generator = pipeline("text-generation", model=str(tmp_path / "hf"), device="cpu")
    theirs = generator("ROMEO:", do_sample=False, max_new_tokens=26, pad_token_id=0)[0]["generated_text"]
    assert theirs == ours and len(ours) == len("ROMEO:") + 26


def test_exported_tokenizer_encodes_and_decodes_as_qkv(translation_export):
    _, tokenizer, _, folder = translation_export
    hf_tokenizer = AutoTokenizer.from_pretrained(folder)
    for text in [*SENTENCES[:5], *GERMAN, "a <s> and </s> typed as text", "Ünïcödé 1998"]:
        assert hf_tokenizer(text).input_ids == tokenizer.encode(text) + [tokenizer.eos_id], text
        assert hf_tokenizer(text, add_special_tokens=False).input_ids == tokenizer.encode(text)
        assert hf_tokenizer.decode(tokenizer.encode(text), skip_special_tokens=True) == text
    assert (hf_tokenizer.pad_token_id, hf_tokenizer.bos_token_id, hf_tokenizer.eos_token_id) == (0, 1, 2)


def test_generation_config_carries_the_runs_decode_settings(translation_export):
    _, _, config, folder = translation_export
    generation = json.loads((folder / "generation_config.json").read_text())
    assert generation["num_beams"] == config["decode"]["beam_size"] == 5
    assert generation["length_penalty"] == config["decode"]["alpha"]
    assert generation["decoder_start_token_id"] == 1 and generation["eos_token_id"] == 2


@pytest.mark.parametrize(
    "change",
    [
        {"share_embeddings": False},
        {"tie_output": False},
        {"share_embeddings": False, "tie_output": False},
        {"bias": False, "activation": "relu"},
        {"activation": "gelu_tanh"},
    ],
)
def test_marian_variants_compute_the_same_logits(translation_export, change):
    """Other exportable settings, on random weights (sharing, tying and biases change the tensors)."""
    base, tokenizer, _, _ = translation_export
    torch.manual_seed(0)
    model = Transformer(replace(base.config, **change)).eval()
    src = _sources(tokenizer, SENTENCES[:2])
    tgt = pad_sequences([[tokenizer.bos_id] + tokenizer.encode(t) for t in GERMAN[:2]], 0)
    hf = build_marian(model, tokenizer)
    with torch.no_grad():
        ours = model(src, tgt)
        theirs = hf(input_ids=src, attention_mask=src != 0, decoder_input_ids=tgt).logits
    real = tgt != 0
    torch.testing.assert_close(theirs[real], ours[real], atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    ("change", "field"),
    [({"norm_first": True}, "norm_first"), ({"positional": "learned"}, "positional")],
)
def test_configurations_marian_cannot_express_are_refused(translation_export, tmp_path, change, field):
    base, tokenizer, config, _ = translation_export
    model = Transformer(replace(base.config, **change)).eval()
    with pytest.raises(ValueError, match=field):
        export_translation(model, tokenizer, config, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_cli_refuses_with_one_line_and_exit_code_2(tmp_path, capsys):
    run_dir = tmp_path / "run"
    shutil.copytree(FIXTURES / "translation_run", run_dir)
    config = json.loads((run_dir / "config.json").read_text())
    config["model"]["layer_norm_eps"] = 1e-6  # same tensors, but Marian's LayerNorm eps is fixed
    (run_dir / "config.json").write_text(json.dumps(config))
    assert main(["export", str(run_dir), "--to", "hf", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "layer_norm_eps" in err
    assert not (tmp_path / "hf").exists()


def test_cli_will_not_write_into_a_folder_with_files(tmp_path, capsys):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "notes.txt").write_text("mine")
    assert main(["export", str(FIXTURES / "translation_run"), "--to", "hf", str(tmp_path / "hf")]) == 2
    assert "not empty" in capsys.readouterr().err
    assert (tmp_path / "hf" / "notes.txt").read_text() == "mine"


def test_character_language_model_exports_as_gpt2(tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(FIXTURES / "lm_run", run_dir)
    assert main(["export", str(run_dir), "--to", "hf", str(tmp_path / "hf")]) == 0
    model, tokenizer, _ = load_run(run_dir)
    hf = GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    hf_tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = "ROMEO:\nWhat say you, my lord?\n"
    assert hf_tokenizer(text).input_ids == tokenizer.encode(text)
    assert hf_tokenizer.decode(tokenizer.encode(text)) == text
    ids = torch.tensor([tokenizer.encode(text)])
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=ids).logits, model(ids).logits, atol=1e-5, rtol=0)


def test_bpe_language_model_without_biases_exports_as_gpt2(tmp_path):
    tokenizer = Tokenizer.load(FIXTURES / "translation_run" / "tokenizer.json")
    config = CausalLMConfig(vocab_size=300, d_model=16, num_heads=2, num_layers=2, d_ff=32, context=32, bias=False)
    torch.manual_seed(0)
    model = CausalLM(config).eval()
    export_language_model(model, tokenizer, tmp_path / "hf")
    hf = GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    assert AutoTokenizer.from_pretrained(tmp_path / "hf")(GERMAN[0]).input_ids == tokenizer.encode(GERMAN[0])
    ids = torch.tensor([tokenizer.encode(GERMAN[0])])
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=ids).logits, model(ids).logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    ("change", "field"),
    [({"norm_first": False}, "norm_first"), ({"positional": "sinusoidal"}, "positional")],
)
def test_language_models_unlike_gpt2_are_refused(change, field):
    tokenizer = Tokenizer.load(FIXTURES / "translation_run" / "tokenizer.json")
    config = CausalLMConfig(vocab_size=300, d_model=16, num_heads=2, num_layers=1, d_ff=32, context=32, **change)
    with pytest.raises(ValueError, match=field):
        build_gpt2_model(CausalLM(config), tokenizer)
