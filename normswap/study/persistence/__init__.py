"""The study's files.

study_dir.py (DIR: the run file, one file per unit, resume), results_writer.py (results.json,
atomically, and the run marked finished).
"""
