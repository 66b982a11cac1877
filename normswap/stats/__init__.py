"""normswap's statistics, one module for each kind of mathematics, used alike by the timing
instrument, the evaluation, the study and the report.

- levels: the confidence level (95 %), each test's α and the power every plan asks for, written once;
- quantiles: Student's t and the normal distribution (the one wrapper around scipy.stats);
- t_intervals: mean ± t·sd/√n of per-seed values and of paired differences, with the t-test's p-value;
- sign_flip: the exact two-sided sign-flip (randomization) test of paired differences;
- equivalence: two one-sided tests (TOST) against ±margin, and the opposite finding;
- multiple_comparisons: Holm's step-down adjustment of a family of p-values;
- power_analysis: what n seeds can decide with the equivalence test;
- bootstrap: percentile bootstraps (of a median over pairs, blocked by seed, over token blocks, two-way);
- verdicts: the rules that turn a speed-ratio interval and its null control into words.

Nothing here reads results.json or knows a command: callers shape the numbers for their files.
"""
