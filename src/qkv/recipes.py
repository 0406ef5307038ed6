"""Recipes: the defaults for a model and its training, per data source (what `qkv train --data X`
uses unless an option overrides it). Each recipe is declared once, here."""

from __future__ import annotations

# Recipes: defaults for a model and its training, per data source. The Multi30k recipe is sized for
# an hour on a 2-core CPU (see benchmarks/train_multi30k.py); the date recipe for the demo's
# three minutes. Anything given explicitly overrides them.
RECIPES: dict[str, dict] = {
    "multi30k": {
        "vocab_size": 8000,
        "split_digits": False,
        "model": dict(d_model=256, num_heads=4, num_encoder_layers=3, num_decoder_layers=3, d_ff=1024, dropout=0.1,
                      max_len=256, share_embeddings=True, tie_output=True),
        # ~3.7k target tokens a step (124 steps an epoch): more updates than 6k-token batches in an hour
        # of CPU; warmup 400 with factor 0.7 reaches the same peak (2.2e-3) as warmup 800 with factor 1.
        # bf16 autocast only where it is fast (qkv.precision.bf16_is_fast); start_run turns it off elsewhere.
        "train": dict(max_tokens=4000, warmup_steps=400, lr_factor=0.7, bf16=True, max_minutes=60.0,
                      eval_every_minutes=6.0, checkpoint_every_minutes=3.0, average_last=5),
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
                      eval_sentences=500, stop_at_exact_match=0.995, average_last=1),
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
    # 32 windows of 128 a step; peak learning rate 0.35 * 256^-0.5 * 100^-0.5 = 2.2e-3
    "train": dict(max_tokens=4096, warmup_steps=100, lr_factor=0.35, label_smoothing=0.0, max_minutes=30.0,
                  eval_every_minutes=2.0, eval_sentences=200, checkpoint_every_minutes=3.0, average_last=1),
}
RECIPES["text"] = RECIPES["tinyshakespeare"]
