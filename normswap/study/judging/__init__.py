"""The study's verdicts, drawn from its units.

results.py (per-unit summaries and paired comparisons), claim_judges.py (each claim's interval,
equivalence test and Holm-adjusted verdict), speed.py (the throughput claim), power.py (what the
seeds can decide), analysis.py (the study's decision from its units), bottom_line.py (what it
found, in words).
"""
