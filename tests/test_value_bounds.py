"""Every size and rate ``qkv train``, ``qkv generate``, a recipe or the Python API takes is bounded
before memory is spent: one line naming the value (and the recipe file it came from), exit 2, and
no run folder left behind."""

from __future__ import annotations

import pytest
from test_reliability import one_line_error, write_pairs

from qkv.cli import main
from qkv.data import tokenizer as tokenizer_module
from qkv.data.tokenizer import Tokenizer
from qkv.models import options as model_options
from qkv.models.causal_lm import CausalLM, CausalLMConfig
from qkv.models.transformer import EncoderModel, Transformer, TransformerConfig
from qkv.runtime.meta import meta_device
from qkv.training.config import TrainConfig

# the findings of the issue, each an absurd size from the command line, and what the error names
ABSURD_FLAGS = [
    ("--encoder-layers", "100000", "num_encoder_layers must be at most 1,024"),
    ("--decoder-layers", "100000", "num_decoder_layers must be at most 1,024"),
    ("--d-model", "1000000000000000000", "d_model must be at most 65,536"),
    ("--d-ff", "1000000000000000000", "d_ff must be at most 262,144"),
    ("--heads", "1000000000", "num_heads must be at most 65,536"),
    ("--max-len", "1000000000", "max_len must be at most 1,048,576"),
    ("--max-tokens", "1000000000000", "max_tokens (--max-tokens) must be >= 1 and <= 16,777,216"),
    ("--accum-steps", "1000000000000", "accum_steps (--accum-steps) must be >= 1 and <= 65,536"),
    ("--eval-sentences", "1000000000000", "eval_sentences (--eval-sentences) must be >= 1 and <= 16,777,216"),
    ("--warmup", "1" + "0" * 400, "warmup_steps (--warmup) must be >= 1 and <= 1,099,511,627,776"),
    ("--seed", "99999999999999999999999", "seed (--seed) must be >= 0 and <= 4,294,967,295"),
]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    return write_pairs(tmp_path_factory.mktemp("pairs"))


def train(pairs, run_dir):
    src, tgt = pairs
    return ["train", "--train-src", str(src), "--train-tgt", str(tgt), "--run-dir", str(run_dir), "--max-steps", "1"]


def parse_error(capsys, argv):
    with pytest.raises(SystemExit) as stop:
        main(argv)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


@pytest.mark.parametrize("flag, value, message", ABSURD_FLAGS)
def test_an_absurd_size_on_the_command_line_is_one_line_and_no_run_folder(
    tmp_path, capsys, pairs, flag, value, message
):
    code = main([*train(pairs, tmp_path / "run"), flag, value, "--no-progress"])
    assert message in one_line_error(capsys, "train", code)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.parametrize("value", ["1000000000000", "100000000", "259"])
def test_an_absurd_vocabulary_is_refused_before_anything(tmp_path, capsys, pairs, value):
    code = main([*train(pairs, tmp_path / "run"), "--vocab-size", value])
    line = one_line_error(capsys, "train", code)
    assert (
        f"vocab_size (--vocab-size) must be an integer from 260 (256 bytes + 4 specials) to 2,097,152, got {value}"
        in line
    )
    assert not (tmp_path / "run").exists()


def test_prepare_refuses_an_absurd_vocabulary_before_reading_the_corpus(tmp_path, capsys, monkeypatch, pairs):
    """``qkv prepare --vocab-size`` is checked before the corpus is read (it was refused only inside
    the tokenizer trainer, after reading and tokenising every line)."""
    src, tgt = pairs

    def read_corpus(*args, **kwargs):
        raise AssertionError("the corpus was read")

    monkeypatch.setattr("qkv.data.prepared.preparing.prepare_corpus", read_corpus)
    argv = ["prepare", "--train-src", str(src), "--train-tgt", str(tgt), "--out", str(tmp_path / "p")]
    code = main([*argv, "--vocab-size", "100000000"])
    assert "vocab_size (--vocab-size) must be an integer from 260" in one_line_error(capsys, "prepare", code)
    assert not (tmp_path / "p").exists()


def test_the_bounds_leave_real_sizes_alone():
    """The paper's big model and GPT-2 XL's sizes (and more) pass the checks."""
    TransformerConfig(d_model=1024, num_heads=16, d_ff=4096, src_vocab_size=37000, tgt_vocab_size=37000)
    CausalLMConfig(vocab_size=256_000, d_model=12288, num_heads=96, num_layers=96, d_ff=49152, context=131072)
    TrainConfig(max_tokens=1_000_000, accum_steps=64, warmup_steps=4000, max_steps=10**9)


@pytest.mark.parametrize(
    "build, field",
    [
        (lambda: TransformerConfig(d_model=10**18, num_heads=1), "d_model"),
        (lambda: TransformerConfig(num_encoder_layers=100_000), "num_encoder_layers"),
        (lambda: TransformerConfig(max_len=10**9), "max_len"),
        (lambda: TransformerConfig(src_vocab_size=10**12, tgt_vocab_size=10**12), "src_vocab_size"),
        (lambda: TransformerConfig(d_ff=10**18), "d_ff"),
        (lambda: CausalLMConfig(context=10**9), "context"),
        (lambda: CausalLMConfig(num_layers=100_000), "num_layers"),
        (lambda: CausalLMConfig(vocab_size=10**8), "vocab_size"),
        (lambda: TrainConfig(max_tokens=10**12), "max_tokens"),
        (lambda: TrainConfig(warmup_steps=10**400), "warmup_steps"),
        (lambda: TrainConfig(seed=2**64), "seed"),
    ],
)
def test_the_python_api_refuses_absurd_sizes_naming_the_field(build, field):
    with pytest.raises(ValueError, match=rf"^{field}\b.*(at most|<=)"):
        build()


def test_the_tokenizer_refuses_a_vocabulary_before_the_library_allocates_it(monkeypatch):
    """tokenizers aborts the whole process on a vocabulary it cannot allocate: it is never asked."""

    class NoTrainer:
        def BpeTrainer(self, **kwargs):
            raise AssertionError(f"the tokenizers library was asked for {kwargs['vocab_size']}")

    monkeypatch.setattr(tokenizer_module, "trainers", NoTrainer())
    for size in (10**12, 10**8, 259, True):
        with pytest.raises(ValueError, match=r"vocab_size \(--vocab-size\) must be an integer from 260"):
            Tokenizer.train(["a b c"], vocab_size=size)


def recipe(tmp_path, model="", train="", vocab_size=300, extra=""):
    path = tmp_path / "mine.toml"
    path.write_text(
        f'description = "a user\'s recipe"\ntask = "translation"\nvocab_size = {vocab_size}\n{extra}\n'
        f"[model]\nd_model = 32\nnum_heads = 2\nd_ff = 64\n{model}\n"
        f"[train]\nmax_steps = 1\n{train}\n",
        encoding="utf-8",
    )
    return path


@pytest.mark.parametrize(
    "kwargs, key",
    [
        ({"model": "num_encoder_layers = 100000"}, "num_encoder_layers"),
        ({"model": "max_len = 1000000000"}, "max_len"),
        ({"model": "num_decoder_layers = 1000000000000000000"}, "num_decoder_layers"),
        ({"train": "max_tokens = 1000000000000"}, "max_tokens"),
        ({"vocab_size": 100_000_000}, "vocab_size"),
        ({"extra": "tokens_per_step = 1000000000000000000"}, "tokens_per_step"),
    ],
)
def test_an_absurd_size_in_a_recipe_names_the_file_and_key(tmp_path, capsys, pairs, kwargs, key):
    path = recipe(tmp_path, **kwargs)
    code = main([*train(pairs, tmp_path / "run"), "--recipe", str(path)])
    line = one_line_error(capsys, "train", code)
    assert str(path) in line and key in line and any(w in line for w in ("at most", " to ", "<=")), line
    assert not (tmp_path / "run").exists()


def test_the_recipe_itself_trains_within_the_bounds(tmp_path):
    """The recipe the tests above spoil is a valid one."""
    from qkv.runs.recipes import load_recipe

    assert load_recipe(recipe(tmp_path)).model["d_model"] == 32


@pytest.mark.parametrize(
    "nested", ["a = " + "[" * 50_000 + "]" * 50_000, "a = " + "{b = " * 50_000 + "1" + "}" * 50_000]
)
def test_a_recipe_nested_too_deep_is_one_line_naming_the_file(tmp_path, capsys, pairs, nested):
    path = tmp_path / "deep.toml"
    path.write_text(nested, encoding="utf-8")
    code = main([*train(pairs, tmp_path / "run"), "--recipe", str(path)])
    line = one_line_error(capsys, "train", code)
    assert str(path) in line and "nested too deep" in line, line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "flag, value",
    [
        ("--temperature", "1e-300"),
        ("--temperature", "inf"),
        ("--temperature", "nan"),
        ("--temperature", "-1"),
        ("--temperature", "1e300"),
        ("--top-p", "1e-300"),
        ("--top-p", "nan"),
        ("--top-p", "1.5"),
    ],
)
def test_generate_refuses_a_sampling_rate_before_loading_anything(tmp_path, capsys, flag, value):
    # a folder that exists and is no model: the sampling options are refused before it is read
    # (the same check runs before a run folder, a GPT-2 folder or an export is opened)
    code = main(["generate", str(tmp_path), flag, value])
    line = one_line_error(capsys, "generate", code)
    assert flag in line and "must be" in line, line


def test_generate_takes_the_sampling_bounds_themselves(tmp_path, capsys):
    from qkv.models.causal_lm import MAX_TEMPERATURE, MIN_TEMPERATURE, MIN_TOP_P

    for argv in (
        ["--temperature", "0"],
        ["--temperature", str(MIN_TEMPERATURE)],
        ["--temperature", str(MAX_TEMPERATURE)],
    ):
        assert main(["generate", str(tmp_path / "none"), *argv, "--top-p", str(MIN_TOP_P)]) == 2
        assert "model folder not found" in capsys.readouterr().err  # what fails next is the missing model


# ------------------------------------------------- sizes that fit the bounds but not the machine


def sizes_built(config, model):
    built = model(config)
    return sum(p.numel() for p in built.parameters()) + sum(b.numel() for b in built.buffers())


@pytest.mark.parametrize(
    "config, model, encoder_only",
    [
        (
            TransformerConfig(src_vocab_size=700, tgt_vocab_size=700, d_model=32, num_heads=2, d_ff=48),
            Transformer,
            False,
        ),
        (
            TransformerConfig(
                src_vocab_size=500,
                tgt_vocab_size=600,
                d_model=16,
                num_heads=2,
                d_ff=40,
                positional="learned",
                tie_output=False,
            ),
            Transformer,
            False,
        ),
        (
            TransformerConfig(src_vocab_size=500, tgt_vocab_size=500, d_model=16, num_heads=2, d_ff=40),
            EncoderModel,
            True,
        ),
        (CausalLMConfig(vocab_size=300, d_model=32, num_heads=2, d_ff=64, num_layers=3, context=64), CausalLM, None),
    ],
)
def test_the_counted_size_is_a_close_lower_bound_of_the_built_model(config, model, encoder_only):
    counted = (
        config.matrix_parameters() if encoder_only is None else config.matrix_parameters(encoder_only=encoder_only)
    )
    built = sizes_built(config, model)
    assert 0.9 * built <= counted <= built


def test_a_model_larger_than_the_memory_is_refused_before_it_is_built(monkeypatch):
    monkeypatch.setattr(model_options, "memory_bytes", lambda device=None: 2**30)  # a 1 GiB machine
    config = CausalLMConfig(vocab_size=2**20, d_model=1024, num_heads=8, num_layers=2, d_ff=1024, context=64)
    with pytest.raises(ValueError, match=r"needs 4\.\d GiB for its float32 weights, more than the 1\.0 GiB"):
        CausalLM(config)  # 2**30 embedding values alone: 4 GiB
    with meta_device():  # the meta device holds nothing: counting parameters stays possible
        assert sum(p.numel() for p in CausalLM(config).parameters()) > 2**30


def test_a_model_that_cannot_be_trained_here_leaves_no_run_folder(tmp_path, capsys, pairs, monkeypatch):
    # a 64 MiB machine: 6 + 6 layers 1024 wide hold about 170M parameters, 2.5 GiB to train
    monkeypatch.setattr(model_options, "memory_bytes", lambda device=None: 64 * 2**20)
    argv = [
        *train(pairs, tmp_path / "run"),
        "--d-model",
        "1024",
        "--d-ff",
        "4096",
        "--heads",
        "8",
        "--vocab-size",
        "300",
    ]
    code = main([*argv, "--device", "cpu", "--no-progress"])
    line = one_line_error(capsys, "train", code)
    assert "GiB for training" in line and "than the 0.1 GiB the cpu device has" in line, line
    assert not (tmp_path / "run").exists()
