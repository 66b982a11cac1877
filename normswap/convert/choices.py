"""Convert's choices and defaults, shared by its command and the recipe schema (imports nothing:
`--help` and recipe validation read it)."""

GAMMA_CHOICES = ("fold", "keep", "reset")
BETA_CHOICES = ("fold", "drop", "keep")
MODES = ("auto", "exact", "approx")
OUTPUT_DTYPES = ("auto", "float32", "float16", "bfloat16")
DEFAULT_TOLERANCE = 1e-4  # max |Δ log-prob| an exact conversion may show
