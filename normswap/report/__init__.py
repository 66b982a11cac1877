"""Report: results.json, report.md, self-contained report.html and PNG figures."""

from normswap.report.report_dir import render_into, rerender, write_report

__all__ = ["render_into", "rerender", "write_report"]
