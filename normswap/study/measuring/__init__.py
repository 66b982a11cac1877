"""The study's measurements besides the training loss.

measure.py (what a step measures besides its loss), speed_phase.py (the speed, measured once after
training), precision.py (the norm kernels in bf16 / fp16 against float64), baselines.py (count
models scored on the held-out blocks).
"""
