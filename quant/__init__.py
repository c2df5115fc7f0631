"""exl's quantizer: calibrated mixed-precision quantization into the exl format (docs/format.md).

Entry point: `quant.convert.convert(Job(...))`, used by `convert.py` and `exl convert`.
Modules: candidates (settings and bit costs), transform (Hadamard, act-order), gptq (rounding),
layer (measure / quantize one matrix), passes (Fisher, measurement, quantization over blocks),
optimize (the bit allocation), writer (the output folder), rotate (the rotated evaluation model).
"""
