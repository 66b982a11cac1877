"""`normswap study`: LayerNorm and RMSNorm arms of the same model trained side by side, with verdicts.

config.py declares the options once; arms.py builds each arm from one initialisation; interleaved.py
steps the arms of one (seed, learning rate) group in turn in one process (each step is
finetune/step.py's, the fine-tune's own); heldout_blocks.py picks the held-out blocks and baselines.py
scores unigram and bigram count models on them; measure.py holds what a
step measures besides its loss (norm-input gradients, memory, the norms' share of step time);
precision.py checks the two norms themselves in low precision; stats.py and claim_judges.py turn the
paired-by-seed numbers into intervals, equivalence tests and Holm-adjusted verdicts; study_dir.py
owns DIR (units kept for resume); runner.py runs the whole study, seed after seed while a verdict
is open; study_report.py renders results.json. Schema: docs/study-schema.md.
"""
