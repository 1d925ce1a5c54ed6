"""The dataset as both sides read it: the corpus formats (corpus/), where a dataset's files are, their
headers, tar shards, Parquet files, object-store reads, the index cache's file and table, and the dataset
agreement between hosts. Nothing is imported here: a producer loads only the modules it uses; the
trainer's index build is consumer/index/ (docs/design/index.md). What a producer's copy must agree on:
docs/design/protocol.md, "Dataset agreement".
"""
