"""Measuring and tuning on this device: timed generation (measure.py), the
cost of a draft step (cost.py), the W x L sweep (sweep.py) and its reports
(report.py)."""
