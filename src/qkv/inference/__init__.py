"""Inference: everything that only decodes, below the trainer (it never imports :mod:`qkv.training`).

- :mod:`~qkv.inference.runs`: :func:`open_run`, a run folder opened after every check (and
  :func:`load_translator`, one run or an ensemble).
- :mod:`~qkv.inference.decode`: :class:`DecodeConfig` and a run's own decoding settings.
- :mod:`~qkv.inference.engines`: the :class:`Translator` protocol and qkv's engine; the CTranslate2
  engine (:mod:`~qkv.inference.ctranslate2`) and the ONNX Runtime one (:mod:`~qkv.inference.onnx_runtime`)
  import their libraries only when made; what each can do is :mod:`~qkv.inference.policy`.
- :mod:`~qkv.inference.generation`: one generator for language models (sampling, stop texts, streaming).
"""

from qkv.inference.ctranslate2 import Ct2Translator
from qkv.inference.decode import DecodeConfig, decode_settings
from qkv.inference.engines import QkvTranslator, Translator, open_translator
from qkv.inference.generation import Continuation, SamplingConfig, TextStream, generate_texts
from qkv.inference.onnx_runtime import OnnxTranslator
from qkv.inference.policy import ENGINES, EngineInfo, check_engine
from qkv.inference.runs import OpenRun, is_run_folder, load_run, load_translator, open_run, read_run_config, run_task

__all__ = [
    "ENGINES",
    "Continuation",
    "Ct2Translator",
    "DecodeConfig",
    "EngineInfo",
    "OnnxTranslator",
    "OpenRun",
    "QkvTranslator",
    "SamplingConfig",
    "TextStream",
    "Translator",
    "check_engine",
    "decode_settings",
    "generate_texts",
    "is_run_folder",
    "load_run",
    "load_translator",
    "open_run",
    "open_translator",
    "read_run_config",
    "run_task",
]
