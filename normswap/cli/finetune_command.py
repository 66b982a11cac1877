"""`normswap finetune MODEL OUT`: the short warmup fine-tune that heals a converted model.

The options are generated from ``normswap.finetune.config.FinetuneConfig`` (one declaration for
the CLI, the recipe schema and the validation); options shared with other commands keep their
shared declaration from cli/options.py.

Also runs under several processes with the same options:
    torchrun --nproc_per_node 2 -m normswap finetune MODEL OUT ...          (DDP; works on CPU)
    accelerate launch --config_file normswap/finetune/configs/fsdp.yaml -m normswap finetune ...
--batch-size is the global batch, split across processes and --grad-accum steps.
"""

from __future__ import annotations

import json
import math

import click
from click.core import ParameterSource

from normswap.cli.options import (
    config_options,
    data_option,
    device_option,
    force_option,
    json_option,
    quiet_option,
    seed_option,
    trust_remote_code_option,
)
from normswap.finetune.config import options

# fields whose option is shared with other commands (declared once, in cli/options.py)
SHARED = {"data": data_option, "seed": seed_option, "device": device_option(), "force": force_option}


@click.command("finetune")
@click.argument("model")
@click.argument("out", required=False, type=click.Path(file_okay=False))
@config_options([f for f in options() if f.metadata["cli"]], SHARED)
@trust_remote_code_option
@json_option
@quiet_option
@click.pass_context
def finetune(ctx, model, out, as_json, quiet, **opts):
    """Fine-tune MODEL (anything convert accepts or produced) into OUT; `normswap finetune OUT --resume`
    continues the run in OUT with its recorded options.

    OUT receives the model in convert's format (loads with from_pretrained(OUT, trust_remote_code=True)),
    train_log.jsonl (one row per step), finetune_run.json (the options and status) and, while running,
    resumable checkpoints in OUT/checkpoints.
    """
    from normswap.errors import NormswapError
    from normswap.network import require_hub

    if out is None:
        if not opts["resume"]:
            raise NormswapError("missing OUT: normswap finetune MODEL OUT (or normswap finetune OUT --resume)")
        model, out = None, model
    # offline: one line now, not a minute of hub retries after the model has loaded
    require_hub(models=(model, opts.get("distill_from")), data=opts.get("data"))
    from normswap.finetune.config import FinetuneConfig

    given = {
        name
        for name in opts
        if ctx.get_parameter_source(name) in (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT)
    }
    if model is not None:
        given.add("model")
    import contextlib
    import os

    from normswap.finetune.run_dir import check_new_out, check_out_overlap

    cfg = FinetuneConfig(model=model, out=out, **opts)
    # before OUT's lock file is made beside OUT, and before torch or anything else loads
    check_new_out(cfg)
    check_out_overlap(cfg)
    # one lock per run: the main process of a distributed launch holds it (RANK is set by the launcher)
    from normswap.finetune.run_dir import RunDir
    from normswap.finetune.trainer import Hooks, run_finetune
    from normswap.progress import Heartbeat, StepProgress, command_lines
    from normswap.publish import output_lock

    # in a terminal the fine-tune shows a bar; elsewhere (a log, CI, nohup) a line every 10 s
    heartbeat = Heartbeat(
        (lambda m: None) if quiet else command_lines("finetune"),
        enabled=False if quiet else None if opts.get("progress") is None else not opts["progress"],
    )
    progress = StepProgress(RunDir(out), cfg.steps, heartbeat.update)
    main = os.environ.get("RANK", "0") == "0"
    with (
        output_lock(out, create_parent=True) if main else contextlib.nullcontext(),
        heartbeat if main else contextlib.nullcontext(),
    ):
        summary = run_finetune(
            cfg,
            given=given,
            hooks=Hooks(after_step=progress, started=progress.start),
            echo=lambda m: heartbeat.say(m.removeprefix("normswap finetune: ")),
        )
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return
    if as_json:
        click.echo(json.dumps(summary, indent=2))
        return
    from normswap.finetune.objectives import heldout_line

    click.echo(f"fine-tuned {summary['model']} -> {summary['out']}")
    click.echo(
        f"  steps {summary['steps']} x {summary['global_batch']} x {summary['seq_len']} tokens "
        f"on {summary['world_size']} process(es), "
        f"{summary['trainable_parameters']:,} trainable parameters, {summary['wall_seconds']:.1f} s"
    )
    click.echo(f"  {heldout_line(summary)}")
    if summary["final_train_loss"] is not None and math.isfinite(summary["final_train_loss"]):
        click.echo(f"  last train loss {summary['final_train_loss']:.4f}; log: {summary['out']}/train_log.jsonl")
