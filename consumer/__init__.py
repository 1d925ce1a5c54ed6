"""The trainer side: the feed core, the scheduler and its ROUTER loop, the queue, the epoch plan, checkpoints,
stoker's trainer and the built-in model. It imports shared/ and producer/ (validation makes batches as
producers do), never the application layer."""

if __name__ != "stoker.consumer":  # consumer/ is stoker.consumer, under no other name
    raise ImportError(f"import stoker.consumer, not {__name__} (docs/DESIGN.md, Layout)")
