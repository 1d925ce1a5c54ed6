"""stoker's application layer: the command line, the launcher and its supervision of the
processes, the producer auto-scaler, device planning, ``diagnose`` and ``watch``.

It sits above the libraries it drives (``consumer/``, ``producer/``, ``shared/``): it
imports them, they never import it (tests/test_layers.py keeps it so). The processes it
starts are named by module (``python -m consumer.main``, ``python -m producer.worker``).
"""
