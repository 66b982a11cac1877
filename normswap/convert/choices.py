"""What convert may do with each LayerNorm's γ and β (imports nothing: the CLI's --help reads it)."""

GAMMA_CHOICES = ("fold", "keep", "reset")
BETA_CHOICES = ("fold", "drop", "keep")
