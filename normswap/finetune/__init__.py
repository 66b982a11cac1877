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
"""

from normswap.finetune.data import TrainStream, eval_blocks
from normswap.finetune.schedule import lr_factor
from normswap.finetune.trainer import (
    FinetuneConfig,
    TrainingDiverged,
    TrainingInterrupted,
    heldout_loss,
    run_finetune,
)

__all__ = [
    "FinetuneConfig", "TrainStream", "TrainingDiverged", "TrainingInterrupted", "eval_blocks", "heldout_loss",
    "lr_factor", "run_finetune",
]
