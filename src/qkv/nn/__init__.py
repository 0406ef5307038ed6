"""The building blocks of the models above attention: dropout, the feed-forward and
encoder/decoder layers, position encodings and the losses."""

from qkv.nn.dropout import Dropout, dropout_off
from qkv.nn.layers import DecoderLayer, EncoderLayer, FeedForward, LayerOutput
from qkv.nn.loss import label_smoothed_cross_entropy
from qkv.nn.positional import LearnedPositionalEncoding, SinusoidalPositionalEncoding, sinusoidal_table

__all__ = [
    "DecoderLayer",
    "Dropout",
    "EncoderLayer",
    "FeedForward",
    "LayerOutput",
    "LearnedPositionalEncoding",
    "SinusoidalPositionalEncoding",
    "dropout_off",
    "label_smoothed_cross_entropy",
    "sinusoidal_table",
]
