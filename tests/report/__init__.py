"""dpo-state report: a run's summary, series and charts."""
