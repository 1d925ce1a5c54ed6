"""A producer: its side of the protocol (worker.py) and what it makes a batch of (batches.py: audio,
transforms, log-mel features, the feature cache, collation). It imports only shared/."""
