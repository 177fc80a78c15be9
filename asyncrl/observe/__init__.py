"""Seeing a run: metrics, the exporter, status, plots, inspection, the watchdog."""
