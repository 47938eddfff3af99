"""opsd: On-Policy Self-Distillation for language models."""

__version__ = "0.1.0"
