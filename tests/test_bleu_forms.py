"""BLEU in the published forms (qkv.metrics.bleu_forms) against independent references: a direct n-gram
count loop (multi-bleu.perl's formula), sacremoses called directly, the Moses outputs for known
strings, sacrebleu on detokenised text, and the word counts the Multi30k dataset publishes for its
own lowercased, normalised, Moses-tokenized files."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
from collections import Counter

import pytest
import sacrebleu
from sacremoses import MosesPunctNormalizer, MosesTokenizer

from qkv.data.spec import DataSpec
from qkv.metrics.bleu_forms import (
    compound_split_form,
    moses_tokenize,
    papers_form,
    published_forms,
    split_compounds,
    token_bleu,
)
from qkv.metrics.scores import score_translations


def multi_bleu(hypotheses: list[str], references: list[str]) -> float:
    """multi-bleu.perl's corpus BLEU on whitespace tokens, written out: clipped n-gram matches
    over the corpus for n = 1..4, geometric mean of the precisions, brevity penalty."""
    matches, totals = [0] * 4, [0] * 4
    hyp_len = ref_len = 0
    for hyp, ref in zip(hypotheses, references):
        h, r = hyp.split(), ref.split()
        hyp_len, ref_len = hyp_len + len(h), ref_len + len(r)
        for n in range(1, 5):
            h_grams = Counter(tuple(h[i : i + n]) for i in range(len(h) - n + 1))
            r_grams = Counter(tuple(r[i : i + n]) for i in range(len(r) - n + 1))
            matches[n - 1] += sum(min(c, r_grams[g]) for g, c in h_grams.items())
            totals[n - 1] += max(0, len(h) - n + 1)
    if min(matches) == 0:
        return 0.0
    log_precision = sum(math.log(m / t) for m, t in zip(matches, totals)) / 4
    brevity = 1.0 if hyp_len >= ref_len else math.exp(1 - ref_len / hyp_len)
    return 100 * brevity * math.exp(log_precision)


HYPS = [
    "the cat sat on the mat .",
    "a man is riding a red bike down the street",
    "two dogs play in the snow",
    "a woman sings on stage",
]
REFS = [
    "the cat sat on a mat .",
    "a man rides a red bicycle down the street .",
    "two dogs are playing in the snow .",
    "a woman is singing on a stage .",
]


def test_token_bleu_equals_a_direct_count():
    expected = multi_bleu(HYPS, REFS)
    assert 0 < expected < 100
    assert token_bleu(HYPS, REFS).score == pytest.approx(expected, abs=1e-9)
    # longer hypotheses than references: no brevity penalty
    assert token_bleu(REFS, HYPS).score == pytest.approx(multi_bleu(REFS, HYPS), abs=1e-9)
    # tokens are case-sensitive and taken as given (no tokenization of their own)
    assert token_bleu(["The cat sat on the mat ."], ["the cat sat on the mat ."]).score == pytest.approx(
        multi_bleu(["The cat sat on the mat ."], ["the cat sat on the mat ."])
    )
    assert token_bleu(["a b c d e"], ["a b c d e"]).score == pytest.approx(100.0)
    assert token_bleu(["a b c"], ["x y z"]).score == 0.0  # no smoothing: a zero precision gives 0


@pytest.mark.parametrize(
    "lang,text,expected",
    [
        ("en", "Don't stop, Mr. Smith! It's 3.5 km (approx.)", "don 't stop , mr. smith ! it 's 3.5 km ( approx . )"),
        (
            "de",
            "Das ist's, sagte Hans-Peter. „Schön“ – z.B. 1.000,50 Euro",
            'das ist \' s , sagte hans-peter . " schön " - z.b. 1.000,50 euro',
        ),
        ("fr", "L'homme qu'il a vu « bonjour » !", "l' homme qu' il a vu \" bonjour \" !"),
    ],
)
def test_papers_form_of_known_strings(lang, text, expected):
    # what the Moses scripts give (lowercase.perl | normalize-punctuation.perl -l L | tokenizer.perl -l L):
    # English splits n't/'s to the right, French keeps l'/qu' on the left, German splits the apostrophe off
    assert papers_form(text, lang) == expected
    direct = MosesTokenizer(lang=lang).tokenize(
        MosesPunctNormalizer(lang=lang, perl_parity=True).normalize(text.lower()), return_str=True, escape=False
    )
    assert papers_form(text, lang) == direct


def test_papers_form_lowercases_before_tokenizing():
    # lowercased first (the dataset's order): "Mr." then ends a word followed by a lowercase one and stays whole
    assert papers_form("I saw Mr. Smith.", "en") == "i saw mr. smith ."
    assert papers_form("The sign said STOP.", "en") == "the sign said stop ."


def test_compound_splitting():
    assert split_compounds("ein rich-text format") == "ein rich ##AT##-##AT## text format"
    # left to right without overlaps, as Perl's s{(\S)-(\S)}{$1 ##AT##-##AT## $2}g: a one-letter part
    # between two hyphens was consumed by the first match, so the second hyphen stays
    assert split_compounds("a-b-c") == "a ##AT##-##AT## b-c"
    assert split_compounds("ab-cd-ef") == "ab ##AT##-##AT## cd ##AT##-##AT## ef"
    assert split_compounds("a - b -x y-") == "a - b -x y-"  # a hyphen with a space beside it is no compound
    # Moses tokenization with the German rules, case kept, then the split
    text = 'Die Hans-Böckler-Stiftung sagt: "Nein".'
    tokenized = MosesTokenizer(lang="de").tokenize(text, return_str=True, escape=False)
    assert moses_tokenize(text, "de") == tokenized == 'Die Hans-Böckler-Stiftung sagt : " Nein " .'
    assert compound_split_form(text, "de") == 'Die Hans ##AT##-##AT## Böckler ##AT##-##AT## Stiftung sagt : " Nein " .'


@pytest.mark.skipif(shutil.which("perl") is None, reason="perl not installed")
def test_compound_splitting_equals_the_perl_one_liner():
    lines = ["a-b-c ab-cd-ef", "Hans-Böckler-Stiftung - x- -y", "E-Mail-Adresse , 3-4 -- a--b", "--a-"]
    perl = subprocess.run(
        ["perl", "-ple", "s{(\\S)-(\\S)}{$1 ##AT##-##AT## $2}g"],
        input="\n".join(lines) + "\n",
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    assert [split_compounds(line) for line in lines] == perl


def test_published_forms_score_the_converted_text():
    hyps = ["Ein Mann fährt ein rotes E-Bike.", "Zwei Hunde spielen im Schnee!", "Eine Frau singt."]
    refs = ["Ein Mann fährt ein rotes Fahrrad.", "Zwei Hunde spielen im Schnee.", "Eine Frau singt auf der Bühne."]
    forms = published_forms(hyps, refs, "de")
    papers = multi_bleu([papers_form(h, "de") for h in hyps], [papers_form(r, "de") for r in refs])
    split = multi_bleu([compound_split_form(h, "de") for h in hyps], [compound_split_form(r, "de") for r in refs])
    assert forms["bleu_papers_form"]["bleu"] == round(papers, 2)
    assert forms["bleu_compound_split"]["bleu"] == round(split, 2)
    assert "lowercased" in forms["bleu_papers_form"]["form"] and "##AT##" in forms["bleu_compound_split"]["form"]
    assert "bleu_compound_split" not in published_forms(hyps, refs, "en")  # the WMT En-De convention only


def test_score_translations_keeps_sacrebleu_and_adds_the_forms():
    hyps = ["A man rides a red bike.", "Two dogs play in the snow!", "A woman is singing."]
    refs = ["A man rides a red bicycle.", "Two dogs are playing in the snow.", "A woman is singing on stage."]
    scores = score_translations(hyps, refs, target_lang="en")
    assert scores["bleu"] == round(sacrebleu.corpus_bleu(hyps, [refs]).score, 2)
    assert scores["chrf"] == round(sacrebleu.corpus_chrf(hyps, [refs]).score, 2)
    assert scores["bleu_papers_form"]["bleu"] == round(
        multi_bleu([papers_form(h, "en") for h in hyps], [papers_form(r, "en") for r in refs]), 2
    )
    assert "bleu_papers_form" not in score_translations(hyps, refs)  # no language: sacreBLEU only
    with pytest.raises(ValueError, match="2 hypotheses but 3 references"):
        score_translations(hyps[:2], refs, target_lang="en")
    with pytest.raises(ValueError, match="language code"):
        score_translations(hyps, refs, target_lang="German")


def test_papers_form_token_counts_match_the_multi30k_release(multi30k_file):
    """The Multi30k dataset's README gives the word counts of its lowercased, normalised, Moses-
    tokenized files (scripts/task1-tokenize.sh): test 2016 en 12,968, de 12,103, fr 13,988; val de 12,828."""
    from qkv.data.parallel import read_lines

    published = {
        ("test_2016_flickr", "en"): 12968,
        ("test_2016_flickr", "de"): 12103,
        ("test_2016_flickr", "fr"): 13988,
        ("val", "de"): 12828,
    }
    for (split, lang), words in published.items():
        path = multi30k_file(f"{split}.{lang}.gz")
        assert sum(len(papers_form(line, lang).split()) for line in read_lines(path)) == words, (split, lang)


def test_evaluate_json_carries_both_forms(tmp_path, capsys, monkeypatch):
    """qkv evaluate --src/--ref on a tiny run: the JSON has sacreBLEU and both labelled forms, the
    language taken from the reference's name; equal to scoring the written translations directly.
    The translations are fixed (an untrained model's would score 0 in every form)."""
    import qkv.decoding.translate
    from qkv.cli import main
    from qkv.runs.translation import start_run

    fixed = ["a small-scale test!", "one more sentence", "that is good."]
    monkeypatch.setattr(
        qkv.decoding.translate, "translate_texts", lambda model, tokenizer, texts, **kw: fixed[: len(texts)]
    )

    src = ["ein kleiner test .", "noch ein satz hier .", "das ist gut ."] * 20
    tgt = ["a small-scale test.", "one more sentence here.", "that is good."] * 20
    (tmp_path / "train.en").write_text("\n".join(src) + "\n")
    (tmp_path / "train.de").write_text("\n".join(tgt) + "\n")
    run = tmp_path / "run"
    start_run(
        run,
        data=DataSpec(source="files", train_src=str(tmp_path / "train.en"), train_tgt=str(tmp_path / "train.de")),
        model_options=dict(d_model=32, num_heads=2, num_encoder_layers=1, num_decoder_layers=1, d_ff=64),
        train_options=dict(max_steps=1, progress=False),
        vocab_size=300,
        device="cpu",
    )
    hyp_out = tmp_path / "hyp.de"
    assert (
        main(
            [
                "evaluate",
                str(run),
                "--weights",
                "last",
                "--src",
                str(tmp_path / "train.en"),
                "--ref",
                str(tmp_path / "train.de"),
                "--limit",
                "3",
                "--beam",
                "2",
                "--json",
                "--hyp-out",
                str(hyp_out),
            ]
        )
        == 0
    )
    scores = json.loads(capsys.readouterr().out)
    hyps = hyp_out.read_text().splitlines()
    assert hyps == fixed and scores["target_lang"] == "de"
    assert min(scores["bleu"], scores["bleu_papers_form"]["bleu"], scores["bleu_compound_split"]["bleu"]) > 0
    assert scores["bleu"] == round(sacrebleu.corpus_bleu(hyps, [tgt[:3]]).score, 2)
    assert scores["bleu_papers_form"]["bleu"] == round(
        multi_bleu([papers_form(h, "de") for h in hyps], [papers_form(r, "de") for r in tgt[:3]]), 2
    )
    assert scores["bleu_compound_split"]["bleu"] == round(
        multi_bleu([compound_split_form(h, "de") for h in hyps], [compound_split_form(r, "de") for r in tgt[:3]]), 2
    )
    # a bad --tgt-lang: one line, exit 2
    assert (
        main(
            [
                "evaluate",
                str(run),
                "--src",
                str(tmp_path / "train.en"),
                "--ref",
                str(tmp_path / "train.de"),
                "--tgt-lang",
                "German",
            ]
        )
        == 2
    )
    assert "--tgt-lang must be a 2- or 3-letter" in capsys.readouterr().err
