"""``python -m stoker ...``: the same as the ``stoker`` command and ``python run.py``."""

import sys

from stoker.cli import main

sys.exit(main())
