"""LayerNorm -> RMSNorm conversion: plan from family data, apply in memory or streaming."""

from normswap.convert.apply import convert_model
from normswap.convert.plan import ConvertOptions, Plan, build_plan

__all__ = ["convert_model", "ConvertOptions", "Plan", "build_plan"]
