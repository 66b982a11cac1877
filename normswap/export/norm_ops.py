"""--onnx-norm-op: what each RMSNorm becomes in an ONNX graph (onnx.py). A module of its own, with
no imports, so the CLI can offer the choices without importing torch, and onnx.py can read them
without importing the package that lazily imports it."""

ONNX_NORM_OPS = {"simplified": "SimplifiedLayerNormalization", "rmsnormalization": "RMSNormalization"}
DEFAULT_ONNX_NORM_OP = "simplified"
