"""``python -m opsd ...`` is the ``opsd`` command; torchrun launches it as
``torchrun ... -m opsd train ...``."""

from opsd.cli import entry

entry()
