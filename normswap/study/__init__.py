"""`normswap study`: LayerNorm and RMSNorm arms of the same model trained side by side, with verdicts.

Schema of its output: docs/study-schema.md. The package is split by concern: the options and the plan
sit here, at its top, and drive the five subpackages below (each module names its one job in its own
docstring, each subpackage's ``__init__`` indexes its modules):

- Options and the plan (this folder): config.py (the options, declared once), inputs.py (what a
  study reads, fixed by its options), study_plan.py (what it will do, fixed before DIR changes),
  preflight_checks.py (every refusal before DIR changes), runner.py (``run_study``: five named
  stages), distributed.py (under torchrun: process 0's decisions sent to every process).
- training/: arms.py, norm_impl.py, bytes_model.py, sampler.py, heldout_blocks.py, interleaved.py,
  units.py, seeds.py, migration.py, stability.py (the arms, their data and their training loop).
- measuring/: measure.py, speed_phase.py, precision.py, baselines.py (what is measured besides the
  training loss).
- judging/: results.py, claim_judges.py, speed.py, power.py, analysis.py, bottom_line.py (the
  verdicts drawn from the units).
- persistence/: study_dir.py, results_writer.py (DIR and results.json).
- presentation/: study_report.py, console_text.py, progress_display.py (what a reader sees).
"""
