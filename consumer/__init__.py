"""The trainer side, one folder per process: the coordinator process (coordinator/: the ROUTER loop, the
scheduler, leases and peers) and the trainer process's side (feed/: the feed core, hand-out, staging,
checkpoints), which never import each other; what they say to each other is protocol.py, and what both use is
here beside it (the queue buffer.py, the epoch plan plan.py, planfiles.py, shard_order.py, the input position
position.py, the shared-memory slots slots.py, the wire-size check message_size.py). Below them all, the index
build (index/: the dataset's usable clips, which producers never load). Training (training/: stoker's
trainers, the built-in model, the consumer process's training loop) imports the feed, never the reverse. It
imports shared/ and producer/ (the scheduler takes the versions of the user's transforms and models, synthesis
makes a reference clip's mel as producers do), never the application layer. Validation batches, as training
batches, are made by the producers (feed/validation.py)."""

if __name__ != "stoker.consumer":  # consumer/ is stoker.consumer, under no other name
    raise ImportError(f"import stoker.consumer, not {__name__} (docs/DESIGN.md, Layout)")
