"""``python -m opsd ...`` is the ``opsd`` command; torchrun launches it as ``torchrun ... -m opsd train ...``."""

import sys

from opsd.cli import main

sys.exit(main())
