"""LayerNorm -> RMSNorm conversion: plan from family data, executed from any tensor source."""

__all__ = ["convert_checkpoint", "convert_model", "ConvertOptions", "Plan", "build_plan"]


def __getattr__(name):
    # Imported on first use, so that `normswap.convert.config` (read by the CLI's --help) does
    # not pull in torch.
    if name == "convert_model":
        from normswap.convert.apply import convert_model

        return convert_model
    if name == "convert_checkpoint":
        from normswap.convert.pipeline import convert_checkpoint

        return convert_checkpoint
    if name == "ConvertOptions":
        from normswap.convert.config import ConvertOptions

        return ConvertOptions
    if name in ("Plan", "build_plan"):
        from normswap.convert import plan

        return getattr(plan, name)
    raise AttributeError(f"module 'normswap.convert' has no attribute {name!r}")
