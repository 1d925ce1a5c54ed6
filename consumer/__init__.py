"""The trainer side: the feed core, the scheduler and its ROUTER loop, the queue, the epoch plan, checkpoints,
stoker's trainer and the built-in model. It imports shared/ and producer/ (validation makes batches as
producers do), never the application layer."""
