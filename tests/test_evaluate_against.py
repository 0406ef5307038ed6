"""``qkv evaluate RUN --against OTHER``: other runs (decoded on the same sentences) or translation
files compared with the run by sacreBLEU's paired tests; scores checked against sacreBLEU itself."""

import json
import shutil

import pytest
import sacrebleu

from qkv.cli import main
from qkv.data.sources import load_split
from qkv.metrics.significance import paired_significance

TINY = [
    "--d-model",
    "32",
    "--heads",
    "2",
    "--encoder-layers",
    "1",
    "--decoder-layers",
    "1",
    "--d-ff",
    "64",
    "--max-tokens",
    "800",
    "--no-progress",
    "--threads",
    "1",
    "--max-steps",
    "30",
    "--minutes",
    "0",
]
SPLIT = ["--split", "test", "--limit", "60", "--beam", "2"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("against")
    first, other = root / "first", root / "other"
    assert main(["train", "--data", "dates", "--run-dir", str(first), *TINY]) == 0
    assert main(["train", "--data", "dates", "--seed", "5", "--run-dir", str(other), *TINY]) == 0  # own tokenizer
    return first, other


def evaluate(capsys, *args):
    capsys.readouterr()
    code = main(["evaluate", *map(str, args)])
    out = capsys.readouterr()
    return code, out


def test_files_and_runs_are_compared_by_the_paired_tests(runs, tmp_path, capsys):
    first, other = runs
    config = json.loads((first / "config.json").read_text())
    refs = load_split(config["data"], "test").tgt[:60]
    perfect = tmp_path / "refs.txt"
    perfect.write_text("".join(r + "\n" for r in refs) + "extra line past the limit\n", encoding="utf-8")
    hyp = tmp_path / "first.hyp"
    code, out = evaluate(capsys, first, *SPLIT, "--json", "--hyp-out", hyp, "--against", perfect, "--against", other)
    assert code == 0, out.err
    scores = json.loads(out.out)
    results = scores["against"]["results"]
    assert list(results) == [str(first), str(perfect), str(other)]
    hyps = hyp.read_text(encoding="utf-8").splitlines()
    assert results[str(first)]["bleu"] == scores["bleu"] == round(sacrebleu.corpus_bleu(hyps, [refs]).score, 2)
    assert results[str(perfect)]["bleu"] == 100.0
    assert results[str(first)]["p_bootstrap"] is None
    # the other run was decoded here with its own tokenizer: its BLEU is what evaluating it alone gives
    code, alone = evaluate(capsys, other, *SPLIT, "--json")
    assert results[str(other)]["bleu"] == json.loads(alone.out)["bleu"]
    # and the p-values are the paired tests' on these translations (references as the second system)
    direct = paired_significance({"a": hyps, "b": refs}, refs)
    assert results[str(perfect)]["p_randomization"] == direct["b"]["p_randomization"]
    if scores["bleu"] < 90:
        assert results[str(perfect)]["p_randomization"] < 0.05


def test_a_copy_of_the_run_is_not_different(runs, tmp_path, capsys):
    first, _ = runs
    copy = tmp_path / "copy"
    shutil.copytree(first, copy)
    code, out = evaluate(capsys, first, *SPLIT, "--against", copy)
    assert code == 0, out.err
    line = next(line for line in out.out.splitlines() if line.endswith(str(copy)))
    assert "+0.00" in line and "1.000 (randomization)" in line and " 0 differ" in line
    code, out = evaluate(capsys, first, *SPLIT, "--json", "--against", copy)
    result = json.loads(out.out)["against"]["results"][str(copy)]
    assert result["bleu"] == json.loads(out.out)["bleu"] and result["p_randomization"] == 1.0
    assert result["differing"] == 0


def test_bad_comparisons_are_refused_before_decoding(runs, tmp_path, capsys):
    first, other = runs
    short = tmp_path / "short.txt"
    short.write_text("one\ntwo\n", encoding="utf-8")
    cases = [
        (["--against", tmp_path / "missing"], "no such run folder or translations file"),
        (["--against", first], "already compared"),
        (["--against", other, "--against", other], "already compared"),
        (["--against", short], "2 translations for the 60 sentences"),
    ]
    for extra, message in cases:
        code, out = evaluate(capsys, first, *SPLIT, *extra)
        assert code == 2 and message in out.err, (extra, out.err)


def test_runs_of_another_pair_or_a_language_model_are_refused(tmp_path):
    import argparse

    from qkv.cli.evaluate_against import read_against

    def run_folder(name, config):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"model": {}, **config}))
        return str(folder)

    ours = {"data": {"source": "multi30k", "src_lang": "en", "tgt_lang": "de"}}
    args = argparse.Namespace(limit=0)
    same = run_folder("same", ours)
    assert read_against(args, [same], ours, 5)[same]["data"]["tgt_lang"] == "de"
    reverse = run_folder("reverse", {"data": {"source": "multi30k", "src_lang": "de", "tgt_lang": "en"}})
    with pytest.raises(ValueError, match="it translates de->en, this run en->de"):
        read_against(args, [reverse], ours, 5)
    lm = run_folder("lm", {"task": "lm"})
    with pytest.raises(ValueError, match="a language-model run"):
        read_against(args, [lm], ours, 5)
