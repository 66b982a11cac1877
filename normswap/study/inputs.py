"""What a study reads, fixed by its options alone: MODEL as trained (over bytes or its own
tokens) and the data (splits, held-out blocks). The parent and every worker process build both
from the same options, so they live here, below the runner and the units that train."""

from __future__ import annotations

import dataclasses

from normswap.errors import NormswapError
from normswap.study.config import DEFAULT_MODEL, StudyConfig
from normswap.study.training import migration
from normswap.study.training.arms import open_source
from normswap.study.training.heldout_blocks import heldout_blocks


def open_study_source(cfg: StudyConfig):
    """MODEL as the study reads it: with ``--tokens bytes``, its architecture over the byte vocabulary."""
    from normswap.study.training import bytes_model

    source = open_source(cfg.model, from_scratch=cfg.from_scratch)
    if cfg.tokens == "model" or (cfg.tokens == "auto" and not (cfg.model == DEFAULT_MODEL and cfg.from_scratch)):
        return source
    if not source.from_scratch:
        raise NormswapError(
            "--tokens bytes trains MODEL's architecture over bytes from random weights: add --from-scratch, "
            "or --tokens model to train on from its weights with its own tokenizer"
        )
    return dataclasses.replace(
        source, config=bytes_model.byte_config(source.config), tokenizer=bytes_model.byte_tokenizer()
    )


def study_data(cfg: StudyConfig, source) -> dict:
    """The splits, the held-out blocks (and the migration rule's), fixed by the options alone."""
    from normswap.data import finetune_splits

    train_split, eval_spec, eval_split = finetune_splits(cfg.data)
    heldout = heldout_blocks(source.tokenizer, eval_spec, cfg.seq_len, cfg.eval_tokens, split=eval_split)
    eval_set = heldout["blocks"]
    held_out = migration.blocks(source.tokenizer, eval_spec, cfg, eval_set) if len(cfg.multipliers()) > 1 else None
    return {
        "train_split": train_split,
        "eval_split": eval_split,
        "heldout": heldout,
        "eval_set": eval_set,
        "held_out": held_out,
    }
