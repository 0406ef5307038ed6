"""Recipes: the defaults for a model and its training, per data source (what `qkv train --data X`
uses unless an option overrides it), and the paper's base and big models, which `qkv train
--recipe paper-base|paper-big` puts in place of the data's recipe (:func:`recipe_overrides`).
Each recipe is declared once, here."""

from __future__ import annotations

# A recipe's model and training fields for runs in bf16 on hardware where bf16 is fast
# (qkv.runtime.precision.bf16_is_fast): such runs make several times the steps in the same minutes, so they
# can afford more regularisation and a gentler rate. Options given explicitly still win.
MODEL_WHERE_BF16_IS_FAST = "model_where_bf16_is_fast"
TRAIN_WHERE_BF16_IS_FAST = "train_where_bf16_is_fast"

# Recipes: defaults for a model and its training, per data source. The Multi30k recipe is sized for
# an hour on a 2-core CPU (see benchmarks/train_multi30k.py); the date recipe for the demo's
# three minutes. Anything given explicitly overrides them.
RECIPES: dict[str, dict] = {
    "multi30k": {
        "vocab_size": 8000,
        "split_digits": False,
        # GELU in float32: on a 2-core AVX2-only EPYC the hour's ~1,900 steps gave validation BLEU 39.13 against
        # ReLU's 38.50, and validation loss 1.621 against 1.665 at minute 54, with 4% fewer steps (a rule written
        # before the hour; benchmarks/results/multi30k_en_de_epyc_zen4_avx2_fp32{,_gelu}.json)
        "model": dict(d_model=256, num_heads=4, num_encoder_layers=3, num_decoder_layers=3, d_ff=1024, dropout=0.1,
                      activation="gelu", max_len=256, share_embeddings=True, tie_output=True),
        # ~1.85k target tokens a step (~247 steps an epoch) with warmup 800 and factor 0.7, a peak rate of
        # 1.55e-3: on a 2-core AVX2-only EPYC in float32 two hours of it (seeds 0 and 1) made ~3,900 steps and
        # beat ~3.7k-token batches (warmup 400, peak 2.2e-3) on mean validation BLEU by the rule written
        # before (benchmarks/results/multi30k_en_de_epyc_zen4_avx2_fp32_half_batches{,_seed1}.json).
        # The rate decays to zero over the budget's last 30% and the last 2 checkpoints are averaged:
        # on validation, for the 1,555 steps an idle 2-core CPU makes in the hour, 38.15 against 37.09
        # for the inverse square root with the last 5 averaged (benchmarks/results/multi30k_en_de_*).
        # bf16 autocast only where it is fast (qkv.runtime.precision.bf16_is_fast); start_run turns it off elsewhere.
        "train": dict(max_tokens=2000, warmup_steps=800, lr_factor=0.7, schedule="budget", decay_fraction=0.3,
                      bf16=True, max_minutes=60.0, eval_every_minutes=6.0, checkpoint_every_minutes=3.0,
                      average_last=2),
        # beam 5; the length penalty chosen on validation (the highest of 0.6-3.0 for the plain default hour,
        # a rule written first: docs/results.md; benchmarks/results/multi30k/multi30k_en_de_plain_default_lp_on_val.json)
        "decode": {"beam_size": 5, "alpha": 2.2},
        # Where the run is in bf16 and bf16 is fast, the hour is ~3.5x the steps (~45 epochs on a 2-core
        # AVX512-BF16/AMX Xeon), and dropout 0.1 stops gaining at ~30 epochs: dropout 0.2 over the hour
        # there: validation BLEU (beam 5) 38.99 / 39.92 / 38.09 for dropout 0.1 / 0.2 / 0.3, an hour each
        # (benchmarks/results/multi30k/sweeps/recipe_sweep_hour_xeon.json).
        # ReLU stays there: GELU's lead of the hour's first quarter was gone by its end (7,000 steps on a Xeon:
        # validation 39.68 against 40.05-40.85, multi30k_en_de_xeon_amx_bf16_gelu.json)
        MODEL_WHERE_BF16_IS_FAST: dict(dropout=0.2, activation="relu"),
        # and there a lower peak rate (1.6e-3 at 4k tokens): validation BLEU 40.58 against 39.92 for factor 0.7, with
        # the validation loss below at every validation; factor 1.0 fell behind from the start
        # (benchmarks/results/multi30k/multi30k_en_de_xeon_bf16_dropout02_lr05.json, ..._lr10_stopped.json)
        TRAIN_WHERE_BF16_IS_FAST: dict(lr_factor=0.5),
        # The recipe's half-size batches were found there first: ~1.85k target tokens with warmup 800 and a peak
        # rate of 1.1e-3 (1.6e-3 over sqrt 2) made 1.7x the steps, validation loss 1.507 against 1.551 at minute 54
        # and validation BLEU 40.72 against 39.70; quarter-size batches (warmup 1,600: validation loss 1.523, BLEU
        # 40.64) fell between (benchmarks/results/multi30k_en_de_xeon_bf16_{half,quarter}_batches.json)
        # (width, measured there with both of the above: d 384 ended level on validation loss and 1.4 below on
        # validation BLEU, the Transformer-tiny shape d 128 was behind at every validation: d 256 stays;
        # benchmarks/results/multi30k_en_de_xeon_bf16_{d384,tiny_stopped}.json)
    },
    # Dates: 600 BPE tokens (enough that capitalised month and day names become whole tokens), digits
    # split; a 0.2M-parameter pre-LN model (pre-LN trains faster at this size than the paper's
    # post-LN); fresh dates never repeat enough to need dropout. About 1,000 steps reach 99.5%.
    "dates": {
        "vocab_size": 600,
        "split_digits": True,
        "model": dict(d_model=64, num_heads=4, num_encoder_layers=2, num_decoder_layers=2, d_ff=256, dropout=0.0,
                      max_len=64, norm_first=True, share_embeddings=True, tie_output=True),
        "train": dict(max_tokens=1500, warmup_steps=100, lr_factor=0.5, max_minutes=2.5, eval_every_steps=100,
                      eval_sentences=1000, stop_at_exact_match=0.995, average_last=1),
    },
}
RECIPES["files"] = RECIPES["multi30k"]
# Language models (task "lm"): a character-level model sized for half an hour on a 2-core CPU (see
# benchmarks/train_lm.py); any UTF-8 text ("text") gets the same recipe.
RECIPES["tinyshakespeare"] = {
    "task": "lm",
    "lm": {"tokenizer": "char", "windows": "random"},
    "vocab_size": 2000,  # with --tokenizer bpe
    # 3.2M parameters; half an hour is ~5 passes over the text, too few to need dropout
    "model": dict(d_model=256, num_heads=4, num_layers=4, d_ff=1024, context=128, dropout=0.0),
    # 32 windows of 128 a step; peak learning rate 0.35 * 256^-0.5 * 100^-0.5 = 2.2e-3. bf16 autocast
    # only where it is fast, as for Multi30k (start_run turns it off elsewhere): 1.8x the float32
    # tokens/s on a 2-core AVX512-BF16/AMX Xeon (benchmarks/results/lm_vs_hf_xeon_*.json)
    # The run's model is the best validation's weights: where half an hour is many more passes (the
    # Xeon in bf16 makes ~30), this dropout-free model overfits after ~12 minutes.
    "train": dict(max_tokens=4096, warmup_steps=100, lr_factor=0.35, label_smoothing=0.0, max_minutes=30.0,
                  eval_every_minutes=2.0, eval_sentences=200, checkpoint_every_minutes=3.0, average_last=1,
                  bf16=True, final_weights="best"),
}
RECIPES["text"] = RECIPES["tinyshakespeare"]

# How a translation run decodes when qkv evaluate / translate get no --beam / --alpha: a recipe's
# "decode" (stored in the run's config.json when it starts), else this.
DEFAULT_DECODE = {"beam_size": 5, "alpha": 0.6}
MAX_SAVED_BEAM = 100  # as qkv translate --beam: beam search holds that many copies of each sentence


def decode_settings(config: dict, *, beam_size: int | None = None, alpha: float | None = None) -> dict:
    """Beam size and length penalty for a run: the ones given, else the run's own (its recipe's),
    else :data:`DEFAULT_DECODE`."""
    saved = config.get("decode") or {}
    if not isinstance(saved, dict) or set(saved) - set(DEFAULT_DECODE):
        raise ValueError(f"config.json: decode must be an object with {sorted(DEFAULT_DECODE)}, got {saved!r}"[:300])
    settings = {**DEFAULT_DECODE, **saved}
    beam, penalty = settings["beam_size"], settings["alpha"]
    if not isinstance(beam, int) or isinstance(beam, bool) or not 1 <= beam <= MAX_SAVED_BEAM:
        raise ValueError(f"config.json: decode.beam_size must be an integer from 1 to {MAX_SAVED_BEAM}, got {beam!r}")
    if not isinstance(penalty, (int, float)) or isinstance(penalty, bool) or not 0 <= penalty <= 10:
        raise ValueError(f"config.json: decode.alpha must be a number from 0 to 10, got {penalty!r}")
    if beam_size is not None:
        settings["beam_size"] = beam_size
    if alpha is not None:
        settings["alpha"] = alpha
    return settings

# The paper's WMT 2014 English-German models ("Attention Is All You Need": Table 3, section 5), for
# `qkv train --recipe paper-base|paper-big` on a corpus the user brings. What each value follows:
# - sizes: Table 3 (base: d_model 512, 8 heads, 6+6 layers, d_ff 2048, P_drop 0.1; big: 1024, 16
#   heads, d_ff 4096, P_drop 0.3 for En-De), post-LN (section 3.1), sinusoidal positions (3.5), one
#   embedding table for both languages and the output projection (3.4);
# - one BPE vocabulary of about 37,000 tokens for both languages (5.1);
# - Adam 0.9/0.98/1e-9, the inverse-square-root rate with 4,000 warmup steps and factor 1 (5.3),
#   label smoothing 0.1 (5.4); no gradient clipping (the paper names none; fairseq's reproduction,
#   "Scaling Neural Machine Translation", trains with --clip-norm 0 too);
# - ~25,000 target tokens a step (5.1): "tokens_per_step" padded tokens, split into max_tokens x
#   accum_steps x processes by step_batches();
# - 100k steps (base) / 300k (big); checkpoints every 10 minutes on the paper's hardware, which is
#   every ~1,400 of its steps for base (100k steps in 12 hours) and ~600 for big (300k in 3.5 days):
#   kept here in steps, so the averaged stretch of training is the paper's on any hardware; the
#   last 5 (base) / 20 (big) averaged (section 6.1);
# - beam 4, length penalty alpha 0.6 at evaluation ("decode", section 6.1): GNMT's
#   ((5 + length) / 6) ** alpha, the EOS token counted in the length (qkv.decoding.search.length_penalty);
#   output up to the input length + 50 tokens (decoding's extra_len default);
# - bf16 autocast where bf16 matrix products are fast (GPUs); training pairs longer than 256 tokens
#   are dropped, with a count.
PAPER_MODEL = dict(d_model=512, num_heads=8, num_encoder_layers=6, num_decoder_layers=6, d_ff=2048, dropout=0.1,
                   max_len=256, norm_first=False, positional="sinusoidal", share_embeddings=True, tie_output=True)
PAPER_TRAIN = dict(warmup_steps=4000, lr_factor=1.0, schedule="inverse_sqrt", adam_betas=(0.9, 0.98), adam_eps=1e-9,
                   label_smoothing=0.1, clip_norm=0.0, bf16=True, max_steps=100_000, checkpoint_every_steps=1400,
                   average_last=5, eval_every_steps=5000, eval_sentences=500)
RECIPES["paper-base"] = {
    "vocab_size": 37000,
    "split_digits": False,
    "tokens_per_step": 25000,
    "decode": {"beam_size": 4, "alpha": 0.6},
    "model": PAPER_MODEL,
    "train": PAPER_TRAIN,
}
RECIPES["paper-big"] = {
    **RECIPES["paper-base"],
    "model": {**PAPER_MODEL, "d_model": 1024, "num_heads": 16, "d_ff": 4096, "dropout": 0.3},
    "train": {**PAPER_TRAIN, "max_steps": 300_000, "checkpoint_every_steps": 600, "average_last": 20},
}
# the largest batch one process takes at once (padded tokens) before it accumulates several. What
# backward keeps of such a batch under bf16 autocast, counted with torch.autograd.graph's
# saved_tensors_hooks for 30-token sentences at 1,200 and 2,400 tokens and extrapolated: about 6 GB
# (base) and 12 GB (big), besides weights, gradients and Adam state (1.0 GB, 3.4 GB): within a 24 GB
# GPU. A smaller GPU takes --max-tokens N (and the step keeps its size through --accum-steps)
MICRO_BATCH_TOKENS = 12_500


def translation_recipes() -> list[str]:
    """The names ``qkv train --recipe`` accepts: every recipe of a translation model."""
    return sorted(name for name, recipe in RECIPES.items() if recipe.get("task", "translation") == "translation")


def step_batches(tokens_per_step: int, world_size: int, *, max_tokens: int | None = None,
                 accum_steps: int | None = None, micro_batch_tokens: int = MICRO_BATCH_TOKENS) -> tuple[int, int]:
    """Split a step of ``tokens_per_step`` padded tokens among processes and micro-batches.

    A step trains on ``accum_steps x world_size`` batches of up to ``max_tokens`` padded tokens
    each (:class:`~qkv.training.TrainConfig`). Given neither, ``accum_steps`` is the fewest
    micro-batches that keep a batch within ``micro_batch_tokens`` and ``max_tokens`` shares the
    step evenly: 1 process -> 2 x 12,500; 2 -> 1 x 12,500; 8 -> 1 x 3,125 (the paper's 8 GPUs).
    Given one, the other is chosen to come closest to ``tokens_per_step``; given both, both are kept.

    Returns:
        ``(max_tokens, accum_steps)``.
    """
    for name, value in (("tokens_per_step", tokens_per_step), ("world_size", world_size),
                        ("max_tokens", max_tokens), ("accum_steps", accum_steps),
                        ("micro_batch_tokens", micro_batch_tokens)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if max_tokens is not None and accum_steps is not None:
        return max_tokens, accum_steps
    if max_tokens is not None:
        return max_tokens, max(1, round(tokens_per_step / (max_tokens * world_size)))
    if accum_steps is None:
        accum_steps = -(-tokens_per_step // (micro_batch_tokens * world_size))
    return -(-tokens_per_step // (accum_steps * world_size)), accum_steps


def recipe_overrides(name: str, source: str, *, world_size: int = 1, max_tokens: int | None = None,
                     accum_steps: int | None = None) -> tuple[dict, dict, int]:
    """What makes :func:`qkv.runs.translation.start_run` train data of ``source`` with recipe ``name`` in place
    of the data's own: the model and training fields where the two recipes differ (a field either
    leaves out counts as the library default, so nothing of the data's recipe stays behind), and
    the vocabulary size. A recipe with ``tokens_per_step`` gets ``max_tokens``/``accum_steps``
    from :func:`step_batches` for ``world_size`` processes (the given ones kept). The tokenizer's
    digit rule stays the data's (split only for the date task). bf16 is passed only where the
    recipes disagree, so where both want it, start_run's rule applies: on where it is fast.

    Returns:
        ``(model_options, train_options, vocab_size)``; explicit options go over them.

    Raises:
        ValueError: an unknown recipe, or one of a language model.
    """
    from dataclasses import fields

    from qkv.models.transformer import TransformerConfig
    from qkv.training.config import TrainConfig

    if name not in translation_recipes():
        raise ValueError(f"unknown recipe {name!r}; choose one of {', '.join(translation_recipes())}")
    if source not in RECIPES:
        raise ValueError(f"no recipe is declared for data source {source!r}")
    if RECIPES[source].get("task", "translation") != "translation":
        raise ValueError(f"--recipe {name} is a translation recipe; a language model ({source}) trains with its "
                         "data's recipe")
    recipe, own = RECIPES[name], RECIPES[source]

    def differing(config_class, key: str, skip: tuple = (), keep: tuple = ()) -> dict:
        defaults = {f.name: getattr(config_class(), f.name) for f in fields(config_class) if f.name not in skip}
        wanted, current = {**defaults, **recipe[key]}, {**defaults, **own[key]}
        return {k: v for k, v in wanted.items() if k in defaults and (v != current[k] or k in keep)}

    # the fields the data's recipe changes where bf16 is fast are given too, so those stay the named recipe's
    model = differing(TransformerConfig, "model", skip=("src_vocab_size", "tgt_vocab_size", "pad_id"),
                      keep=tuple(own.get(MODEL_WHERE_BF16_IS_FAST, {})))
    train = differing(TrainConfig, "train", keep=tuple(own.get(TRAIN_WHERE_BF16_IS_FAST, {})))
    if "tokens_per_step" in recipe:
        train["max_tokens"], train["accum_steps"] = step_batches(recipe["tokens_per_step"], world_size,
                                                                 max_tokens=max_tokens, accum_steps=accum_steps)
    return model, train, recipe["vocab_size"]
