"""`dpo-state report`: what a run shows (summary and series) and its charts, read from the run directory only.

Above dpo_state, which it reads through (run logs, checkpoint documents, the strict YAML reader): a report is
not persistence. `summary.run_report` is the content (`--json`); `charts.write_report` draws the PNGs and the
self-contained report.html (matplotlib, from the `report` extra).
"""
