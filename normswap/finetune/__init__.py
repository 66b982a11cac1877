"""Warmup fine-tune that heals a converted model: `normswap finetune` (see trainer.py).

Public API:
    FinetuneConfig, run_finetune(cfg) -> summary dict
    heldout_loss(model, blocks, micro_batch=8) -> float   (the held-out loss finetune logs)
    eval_blocks(tokenizer, data_spec, seq_len, max_tokens, split="validation") -> LongTensor
    lr_factor(step, total_steps=, warmup_steps=, schedule=, min_ratio=) -> float
    TrainingDiverged, TrainingInterrupted (NormswapError subclasses, exit 1 and 130)

Several processes: ``torchrun --nproc_per_node N -m normswap finetune ...`` (DDP; CPU/gloo too) or
``accelerate launch --config_file normswap/finetune/configs/fsdp.yaml -m normswap finetune ...``
(FSDP on GPUs). ``--batch-size`` is always the global batch.

Names are imported on first use, so that reading the options (config.py) does not import torch.
"""

import importlib

_HOME = {
    "FinetuneConfig": "config",
    "TrainStream": "batches",
    "eval_blocks": "batches",
    "heldout_loss": "objectives",
    "lr_factor": "schedule",
    "TrainingDiverged": "trainer",
    "TrainingInterrupted": "trainer",
    "run_finetune": "trainer",
}

__all__ = sorted(_HOME)


def __getattr__(name):
    if name in _HOME:
        return getattr(importlib.import_module(f"normswap.finetune.{_HOME[name]}"), name)
    raise AttributeError(f"module 'normswap.finetune' has no attribute {name!r}")
