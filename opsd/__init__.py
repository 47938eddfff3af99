"""opsd: On-Policy Self-Distillation for language models.

from opsd import Trainer, load_config
Trainer(load_config("run.yaml", ["loss.beta=0"])).train()

Importing opsd changes nothing outside it: the `opsd` command's entry point (:func:`opsd.cli.entry`)
is where torch companions built for another torch are hidden (:mod:`opsd.companions`).
"""

__version__ = "0.1.0"

__all__ = ["Config", "Trainer", "load_config", "__version__"]


def __getattr__(name: str):
    # Lazy, so `opsd --version` does not import torch and transformers.
    if name in ("Config", "load_config"):
        from opsd import config

        return getattr(config, name)
    if name == "Trainer":
        from opsd.trainer import Trainer

        return Trainer
    raise AttributeError(f"module 'opsd' has no attribute {name!r}")
