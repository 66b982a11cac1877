"""Command-line interface: one module per command (group), shared options in options.py."""
