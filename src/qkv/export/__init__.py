"""Export trained qkv runs to other formats: Hugging Face folders (:mod:`qkv.export.huggingface`) and
ONNX (:mod:`qkv.export.onnx`). Each exporter writes an exact counterpart of the run's model or refuses
with a one-line reason; nothing is imported here so that each format's dependencies load only when used."""
