"""Options shared by several commands, declared once."""

from __future__ import annotations

import click

DTYPES = ("auto", "float32", "float16", "bfloat16", "float64")


def device_option(default="auto"):
    return click.option(
        "--device",
        default=default,
        show_default=True,
        help="cpu, cuda, cuda:N or auto (cuda when available).",
    )


def dtype_option(default="auto", help_text="Compute dtype (auto: the checkpoint's own; float32 on CPU)."):
    return click.option("--dtype", type=click.Choice(DTYPES), default=default, show_default=True, help=help_text)


json_option = click.option("--json", "as_json", is_flag=True, help="Print a machine-readable JSON summary.")
force_option = click.option("--force", is_flag=True, help="Replace OUT if it exists.")
seed_option = click.option("--seed", type=int, default=0, show_default=True, help="Random seed.")
data_option = click.option(
    "--data",
    default="embedded",
    show_default=True,
    help="embedded (the shipped KJV corpus), a text/JSONL/parquet file or directory, a saved dataset, or a hub dataset id.",
)


def _set_trust_remote_code(ctx, param, value):
    from normswap.checkpoint.load import set_trust_remote_code

    set_trust_remote_code(value)  # also when absent: an earlier in-process command's choice never carries over
    return value


trust_remote_code_option = click.option(
    "--trust-remote-code", is_flag=True, expose_value=False, is_eager=True, callback=_set_trust_remote_code,
    help="Let source models run the Python files they ship (auto_map). Off by default: only for sources you trust. "
         "normswap's own converted checkpoints never need it.",
)
seq_len_option = click.option("--seq-len", type=int, default=None, help="Tokens per sequence (default: min(model context, 512)).")
batch_size_option = click.option("--batch-size", type=int, default=8, show_default=True, help="Sequences per batch.")


def resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        from normswap.errors import NormswapError

        raise NormswapError(f"--device {device} requested but no CUDA device is available")
    return device


def resolve_dtype(dtype: str, device: str):
    """auto -> bfloat16 on CUDA, float32 on CPU."""
    import torch

    if dtype == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    return getattr(torch, dtype)
