"""The trainer side: the index build (index/: the dataset's usable clips, which producers never load), the
pipeline (pipeline/: the feed core, the scheduler and its ROUTER loop, the queue, the epoch plan, checkpoints)
and training (training/: stoker's trainers, the built-in model, the consumer process's training loop), which
imports the pipeline, never the reverse; both import the index build. It imports shared/ and
producer/ (the scheduler takes the versions of the user's transforms and models, synthesis makes a reference
clip's mel as producers do), never the application layer. Validation batches, as training batches, are made by
the producers (pipeline/validation.py)."""

if __name__ != "stoker.consumer":  # consumer/ is stoker.consumer, under no other name
    raise ImportError(f"import stoker.consumer, not {__name__} (docs/DESIGN.md, Layout)")
