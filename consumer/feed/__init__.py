"""The pipeline: what brings batches to a training loop, whoever writes it. The feed core (feed.py), the
coordinator and its scheduler and peers, the queue, the hand-out ledger, the epoch plan, checkpoints of the
input position (and of the model state a trainer gives them), telemetry, the live line and validation. It
never imports training/."""
