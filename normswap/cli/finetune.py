"""`normswap finetune MODEL OUT`: the short warmup fine-tune that heals a converted model.

Also runs under several processes with the same options:
    torchrun --nproc_per_node 2 -m normswap finetune MODEL OUT ...          (DDP; works on CPU)
    accelerate launch --config_file normswap/finetune/configs/fsdp.yaml -m normswap finetune ...
--batch-size is the global batch, split across processes and --grad-accum steps.
"""

from __future__ import annotations

import json
import math

import click

from normswap.cli.options import (
    batch_size_option,
    data_option,
    device_option,
    force_option,
    json_option,
    seed_option,
    seq_len_option,
)


@click.command("finetune")
@click.argument("model")
@click.argument("out", type=click.Path(file_okay=False))
@data_option
@click.option("--steps", type=int, default=200, show_default=True, help="Optimizer steps.")
@click.option("--lr", type=float, default=3e-4, show_default=True, help="Peak learning rate η_max.")
@click.option("--warmup-steps", type=int, default=20, show_default=True, help="Linear warmup: η_t = η_max·min(t/W, 1).")
@click.option("--schedule", type=click.Choice(["constant", "cosine", "linear"]), default="cosine", show_default=True, help="Decay after the warmup.")
@click.option("--min-lr-ratio", type=float, default=0.1, show_default=True, help="cosine/linear decay ends at this fraction of --lr.")
@seq_len_option
@batch_size_option
@click.option("--grad-accum", type=int, default=1, show_default=True, help="Micro-batches per optimizer step (the global batch is still --batch-size).")
@seed_option
@click.option("--save-every", type=int, default=0, show_default=True, help="Write a resumable checkpoint every K steps (0: never).")
@click.option("--keep-checkpoints", type=int, default=2, show_default=True, help="Keep this many newest checkpoints (0: all).")
@click.option("--keep-checkpoints-after-finish", is_flag=True, help="Keep OUT/checkpoints after the final model is written.")
@click.option("--resume", is_flag=True, help="Continue the run in OUT from its newest checkpoint (same options).")
@click.option("--eval-every", type=int, default=0, show_default=True, help="Held-out loss every K steps (always at step 0 and at the end).")
@click.option("--eval-tokens", type=int, default=65536, show_default=True, help="Held-out tokens (from the validation split).")
@click.option("--weight-decay", type=float, default=0.01, show_default=True, help="AdamW weight decay (never on norms or biases).")
@click.option("--clip-grad", type=float, default=1.0, show_default=True, help="Clip the global gradient norm (0: off).")
@click.option("--trainable", type=click.Choice(["all", "norms"]), default="all", show_default=True,
              help="all parameters, or only the normalisation layers' γ/β (refused when exact conversion folded them away).")
@click.option("--distill-from", default=None, help="Teacher model (e.g. the unconverted source): train toward its token distributions.")
@click.option("--distill-alpha", type=float, default=1.0, show_default=True, help="Loss = α·KL(teacher‖student) + (1−α)·LM loss.")
@click.option("--distill-temperature", type=float, default=1.0, show_default=True, help="Softmax temperature of the distillation KL.")
@click.option("--dtype", type=click.Choice(["auto", "float32", "bfloat16", "float64", "float16"]), default="auto", show_default=True,
              help="auto: fp32 weights with bf16 autocast on CUDA, fp32 on CPU.")
@device_option()
@click.option("--progress/--no-progress", default=None, help="Progress bar (default: only on an interactive terminal outside CI).")
@force_option
@json_option
def finetune(model, out, data, steps, lr, warmup_steps, schedule, min_lr_ratio, seq_len, batch_size, grad_accum, seed,
             save_every, keep_checkpoints, keep_checkpoints_after_finish, resume, eval_every, eval_tokens, weight_decay,
             clip_grad, trainable, distill_from, distill_alpha, distill_temperature, dtype, device, progress, force, as_json):
    """Fine-tune MODEL (anything convert accepts or produced) into OUT.

    OUT receives the model in convert's format (loads with from_pretrained(OUT, trust_remote_code=True)),
    train_log.jsonl (one row per step) and, while running, resumable checkpoints in OUT/checkpoints.
    """
    from normswap.finetune import FinetuneConfig, run_finetune

    cfg = FinetuneConfig(
        model=model, out=out, data=data, steps=steps, lr=lr, warmup_steps=warmup_steps, schedule=schedule,
        min_lr_ratio=min_lr_ratio, seq_len=seq_len, batch_size=batch_size, grad_accum=grad_accum, seed=seed,
        save_every=save_every, keep_checkpoints=keep_checkpoints, eval_every=eval_every, eval_tokens=eval_tokens,
        weight_decay=weight_decay, clip_grad=clip_grad, trainable=trainable, distill_from=distill_from,
        distill_alpha=distill_alpha, distill_temperature=distill_temperature, dtype=dtype, device=device,
        resume=resume, force=force, progress=progress, keep_checkpoints_after_finish=keep_checkpoints_after_finish,
    )
    summary = run_finetune(cfg)
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return
    if as_json:
        click.echo(json.dumps(summary, indent=2))
        return
    fmt = lambda v: "n/a" if v is None else f"{v:.4f}"  # noqa: E731
    ppl = lambda v: "n/a" if v is None else f"{v:.2f}"  # noqa: E731
    click.echo(f"fine-tuned {summary['model']} -> {summary['out']}")
    click.echo(f"  steps {summary['steps']} x {summary['global_batch']} x {summary['seq_len']} tokens on {summary['world_size']} process(es), "
               f"{summary['trainable_parameters']:,} trainable parameters, {summary['wall_seconds']:.1f} s")
    click.echo(f"  held-out loss {fmt(summary['initial_eval_loss'])} -> {fmt(summary['final_eval_loss'])}  "
               f"(perplexity {ppl(summary['initial_perplexity'])} -> {ppl(summary['final_perplexity'])})")
    if summary["final_train_loss"] is not None and math.isfinite(summary["final_train_loss"]):
        click.echo(f"  last train loss {summary['final_train_loss']:.4f}; log: {summary['out']}/train_log.jsonl")
