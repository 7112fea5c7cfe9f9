"""Data shipped with the package: the warm starts (train/shipped_warmstart.py)."""
