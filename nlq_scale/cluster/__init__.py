"""Sweep expansion, resource planning, submitit/SLURM submission and run status."""
