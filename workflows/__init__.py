"""Example workflows; each runs with `omniflow run workflows/NAME.py`."""
