"""Greedy translation over an ONNX export: the engine is :mod:`qkv.inference.onnx_runtime` now; the
names qkv 1.x defined here are re-exported."""

from qkv.inference.onnx_runtime import MANIFEST_FORMAT, OnnxTranslator, pad_batch

__all__ = ["MANIFEST_FORMAT", "OnnxTranslator", "pad_batch"]
