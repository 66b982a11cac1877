"""Files shipped inside the package: reference models (`models/`) and lm-eval task files."""
