"""What producers and the trainer share, and nothing of the project above it: the wire protocol, the config,
the batch schema, the dataset as both sides read it, text and vocabulary, keys, metrics, run files and process
plumbing. What only the trainer uses is consumer/'s (the index build: consumer/index/)."""

if __name__ != "stoker.shared":  # shared/ is stoker.shared, under no other name
    raise ImportError(f"import stoker.shared, not {__name__} (docs/DESIGN.md, Layout)")
