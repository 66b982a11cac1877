"""What a reader of the study sees.

study_report.py (report.md, report.html, figures, the terminal summary), console_text.py (the
console's header and notes), progress_display.py (the progress bar or lines).
"""
