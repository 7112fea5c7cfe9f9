"""On-policy distillation from a frozen teacher (docs/distillation.md)."""
