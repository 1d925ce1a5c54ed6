"""Training: stoker's own trainers and the consumer process's training loop (main.py), the built-in TTS
model, synthesis, export, TensorBoard and mel images. It takes its batches from the feed (feed/)."""
