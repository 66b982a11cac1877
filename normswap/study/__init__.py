"""`normswap study`: LayerNorm and RMSNorm arms of the same model trained side by side, with verdicts.

config.py declares the options once; arms.py builds each arm from one initialisation; interleaved.py
steps the arms of one (seed, learning rate) group in turn in one process (each step is
finetune/step.py's, the fine-tune's own); heldout_blocks.py picks the held-out blocks and baselines.py
scores unigram and bigram count models on them; measure.py holds what a
step measures besides its loss (norm-input gradients, memory, the norms' share of step time);
precision.py checks the two norms themselves in low precision; claim_judges.py turns the paired-by-seed
numbers (with normswap/stats/) into intervals, equivalence tests and Holm-adjusted verdicts; study_dir.py
owns DIR (units kept for resume); runner.py runs the whole study in five stages, seed after seed while a
verdict is open (seeds.py decides; preflight_checks.py, distributed.py, analysis.py and
results_writer.py hold the stages' parts); study_report.py renders results.json. Schema: docs/study-schema.md.
"""
