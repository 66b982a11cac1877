"""A checkpoint opened for export: its config, its normswap block and its tensors, matched to its
module tree without loading the model (the same reading convert's verification does)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

import torch

from normswap.checkpoint import load as ckload
from normswap.checkpoint.sizes import check_against_weights
from normswap.checkpoint.tensor_source import SafetensorsFiles, open_source, weight_files
from normswap.convert import tensor_match as ckinputs
from normswap.errors import NormswapError


@dataclass
class Opened:
    path: Path
    config: object
    block: dict | None  # the normswap block (None: a checkpoint normswap did not convert)
    inputs: ckinputs.Inputs
    dtype: torch.dtype  # what from_pretrained(dtype="auto") loads

    def build(self, dtype=torch.float32):
        """A fresh skeleton of the checkpoint's own class (parameters placeholders, buffers real)."""
        return ckinputs.skeleton(self.config, dtype, buffers=True)

    def fetch(self, key, dtype, out=None):
        return self.inputs.read_as(key, dtype, out=out)

    @property
    def causal(self) -> bool:
        return ckload.is_causal_lm(self.config)

    def tokenizer(self):
        """The checkpoint's tokenizer, None where it has none; a refused one refuses the command."""
        return ckload.optional_tokenizer(str(self.path))


def local_model_dir(spec, what: str) -> Path:
    """``spec`` as a local model directory (export reads files; a hub id must be downloaded first)."""
    resolved = ckload.resolve(spec)
    if not ckload.is_local(resolved):
        raise NormswapError(
            f"{what} {spec} is not a local directory: export reads a checkpoint's files "
            "(download it first, e.g. with `huggingface-cli download`)"
        )
    return Path(resolved)


@contextlib.contextmanager
def open_checkpoint(path: Path, label: str, *, files_only=False):
    """``Opened`` for the checkpoint at ``path`` (closed on exit). ``files_only``: safetensors of
    the stock or normswap names only (a directory export just wrote)."""
    config = ckload.load_config(str(path))
    if files_only:
        source = SafetensorsFiles(path, weight_files(path)[1])
    else:
        source = open_source(path, label)
    try:
        # sizes the weights cannot back are refused before even the meta-device skeleton is built
        check_against_weights(config.to_dict(), {k: shape for k, (_, shape) in source.specs.items()}, label)
        dtype = ckinputs.load_dtype(config, source)
        skeleton = ckinputs.skeleton(config, dtype)
        inputs = ckinputs.match(skeleton, source, label)
        yield Opened(Path(path), config, ckload.normswap_block(config), inputs, dtype)
    finally:
        source.close()
