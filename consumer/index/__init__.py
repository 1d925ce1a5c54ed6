"""The trainer's index build (build_index in index.py): a dataset's usable clips and rejections from its
metadata and audio headers (parallel.py), through the rules (rules.py), the index cache reused where it
still holds (reuse.py), a large dataset built in pieces by helper processes (pieces.py, chunked.py,
spill.py, parquet_pieces.py, cuts_pieces.py), the index as built (indexed.py) and its shards and row
groups numbered (groups.py). Producers never import it: what both sides read of a dataset is
shared/dataset/. Nothing is imported here."""
