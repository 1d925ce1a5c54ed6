"""stoker: keep a training GPU fed. See README.md and docs/DESIGN.md.

    python run.py                                  train on the embedded demo data
    python run.py --data-gpu 0 --model-gpu 1       producers on GPU 0, trainer on GPU 1
    python run.py produce --connect tcp://HOST:PORT --data DIR
    python run.py bench

The same as the installed ``stoker`` command, from a checkout: Python puts this file's
directory first on the import path, and stoker's layers are its subpackages there
(docs/DESIGN.md, Layout).
"""

from stoker.cli import main
from stoker.shared.proc import exit_without_teardown

if __name__ == "__main__":
    exit_without_teardown(main())  # sys.exit less the teardown of TensorFlow's modules (synth, export)
