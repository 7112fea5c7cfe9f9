"""Launching jobs, and the study sweep, with NeMo-Run (local torchrun, Slurm)."""
