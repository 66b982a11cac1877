"""`normswap study`: LayerNorm and RMSNorm arms of the same model trained side by side, with verdicts.

Schema of its output: docs/study-schema.md. The modules, by concern (each names its one job in its
own docstring):

- Options and the plan: config.py (the options, declared once), inputs.py (what a study reads, fixed
  by its options), study_plan.py (what it will do, fixed before DIR changes), preflight_checks.py
  (every refusal before DIR changes), runner.py (``run_study``: five named stages), distributed.py
  (under torchrun: process 0's decisions sent to every process).
- Training: arms.py (each arm built from one initialisation), norm_impl.py (which kernel record and
  dtype each arm's norms compute with, detected from the graph), bytes_model.py (the default model,
  over bytes), sampler.py (the training batches), heldout_blocks.py (the held-out blocks),
  interleaved.py (one group's arms stepped in turn), units.py (groups in this process or spread over
  workers), seeds.py (one more seed while a verdict is open), migration.py (the migration rule),
  stability.py (``--stability``: rates rising until each arm diverges).
- Measuring: measure.py (what a step measures besides its loss), speed_phase.py (the speed, measured
  once after training), precision.py (the norm kernels in bf16 / fp16 against float64), baselines.py
  (count models scored on the held-out blocks).
- Judging: results.py (per-unit summaries and paired comparisons), claim_judges.py (each claim's
  interval, equivalence test and Holm-adjusted verdict), speed.py (the throughput claim), power.py
  (what the seeds can decide), analysis.py (the study's decision from its units), bottom_line.py (what
  it found, in words).
- Persistence: study_dir.py (DIR: the run file, one file per unit, resume), results_writer.py
  (results.json, atomically, and the run marked finished).
- Presentation: study_report.py (report.md, report.html, figures, the terminal summary),
  console_text.py (the console's header and notes), progress_display.py (the progress bar or lines).
"""
