"""teacher-server: teacher log-probs of student candidates, for on-policy distillation."""

__version__ = "0.1.0"
