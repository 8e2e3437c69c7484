"""Run loading, scaling-law fits, comparisons, plots and the report."""
