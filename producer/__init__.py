"""A producer: its side of the protocol (worker.py, its connection in link.py) and what it makes a batch
of (batches.py: audio, transforms, log-mel features, the feature cache, collation). It imports only shared/."""

if __name__ != "stoker.producer":  # producer/ is stoker.producer, under no other name
    raise ImportError(f"import stoker.producer, not {__name__} (docs/DESIGN.md, Layout)")
