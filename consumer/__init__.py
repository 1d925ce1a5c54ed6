"""The trainer side, in two parts: the pipeline (pipeline/: the feed core, the scheduler and its ROUTER loop,
the queue, the epoch plan, checkpoints) and training (training/: stoker's trainers, the built-in model, the
consumer process's training loop), which imports the pipeline, never the reverse. It imports shared/ and
producer/ (validation makes batches as producers do), never the application layer."""

if __name__ != "stoker.consumer":  # consumer/ is stoker.consumer, under no other name
    raise ImportError(f"import stoker.consumer, not {__name__} (docs/DESIGN.md, Layout)")
