"""An ONNX export (``normswap export --format onnx``) as `normswap eval` sees a model.

``OnnxModel(path)`` holds an onnxruntime CPU session of DEST/model.onnx and the config.json beside
it, and answers ``model(input_ids=...)`` with an object whose ``.logits`` is a float32 torch tensor
[batch, seq, vocab], so perplexity reads it through the very code it reads a PyTorch model's logits with
(evaluate/perplexity.py: same windows, stride and tokens, comparable numbers), and the speed measurement
times it beside PyTorch models, interleaved like them, with its null control.
What it can measure: perplexity, and ``forward`` tokens/s (one forward; a generation graph's from an
empty cache). What it cannot, and reports as not measured: the training step and the diagnostics (an
inference graph has no backward), generation (its loop is OnnxGenerator's, export/onnx_generate.py),
time inside the norm layers (no module hooks in a graph), peak memory (onnxruntime's allocations are not
torch's) and lm-eval tasks (lm-eval drives a PyTorch model).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch

SPEED_KINDS = ("forward",)
NOT_MEASURED = {
    "train_step": "an ONNX inference graph has no backward",
    "generate": "eval speed times an ONNX graph's forward only (a generation graph's loop: OnnxGenerator)",
    "norm_share": "a graph has no module hooks to time the norms",
    "memory": "onnxruntime's allocations are not tracked by torch",
    "diagnostics": "an ONNX inference graph has no backward (gradient norm) nor module hooks (norm inputs)",
    "tasks": "lm-eval drives a PyTorch model, not an onnxruntime session",
}
# what evaluate() measures on an ONNX export; the rest of what a run chooses is refused for it on the command
# line, and reported per row as not measured where a recipe evaluates ONNX rows beside PyTorch ones
MEASURED = ("perplexity", "speed", "memory")


class OnnxModel:
    is_onnx = True
    main_input_name = "input_ids"
    speed_kinds = SPEED_KINDS
    training = False

    def __init__(self, path, threads: int | None = None):
        from normswap.checkpoint.load import load_config
        from normswap.checkpoint.manifest import read_manifest
        from normswap.export.onnx import read_export, session

        self.path = Path(path)
        self.graph = read_export(self.path)  # refused in one line when another user could have written it
        self.config = load_config(str(self.path))
        self.export = (read_manifest(self.path) or {}).get("export") or {}
        self.session = session(self.graph, threads=threads or torch.get_num_threads())
        self.output = (self.export.get("outputs") or ["logits"])[0]

    def forward(self, input_ids=None, use_cache=False, **unused):
        from normswap.export.onnx import run_session

        # float32 from the graph as it is (an int8 graph's outputs are float32 too): what perplexity reads
        out = run_session(self.session, input_ids).float()
        return SimpleNamespace(**{"logits": None, self.output: out})

    __call__ = forward

    # what code written for nn.Module asks of a model
    def parameters(self):
        return iter(())

    def modules(self):
        return iter(())

    def named_modules(self):
        return iter(())

    def eval(self):
        return self

    def train(self, mode=True):
        if mode:
            raise TypeError("an ONNX model cannot be trained")
        return self

    def to(self, *args, **kwargs):
        return self
