"""The benchmarks `normswap bench` runs, one module each: norm_kernels (the RMSNorm implementations
against LayerNorm), decode (converted against original decode at batch 1), onnx_runtime (the ONNX
exports in onnxruntime), conversion (convert against copying the files). Each times with the one
instrument, normswap/timing.py; bench/ keeps the scripts that drive them and the committed results."""
