"""Reports of benchmark runs: text tables (tables.py) and PNG plots (plot.py, needs matplotlib)."""
