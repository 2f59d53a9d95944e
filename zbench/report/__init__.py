"""HTML reports: ``render(run_dir, report_dir)`` writes a self-contained ``index.html``."""

from zbench.report.render import render

__all__ = ["render"]
