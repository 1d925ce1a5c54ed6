"""The trainer process's side: what brings batches to a training loop, whoever writes it. The feed core
(feed.py), the coordinator process as the trainer sees it (handoff.py), the hand-out ledger, staging for each
framework, checkpoints of the input position (and of the model state a trainer gives them), telemetry, the
live line and validation. It imports the coordinator process's side only through consumer/protocol.py, and
never training/."""
