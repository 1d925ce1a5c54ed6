"""``python -m stoker ...``: the same as the ``stoker`` command and ``python run.py``."""

from .cli import main
from .shared.proc import exit_without_teardown

exit_without_teardown(main())  # sys.exit less the teardown of TensorFlow's modules (synth, export)
