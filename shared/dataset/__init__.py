"""The dataset index: which clips exist, how long they are, and which were rejected.

Layout (LJSpeech): ``DIR/metadata.csv`` with one ``id|text|normalized_text`` line per
clip (a plain ``id|text`` line is accepted too; the last field is the text used), and
the audio in ``DIR/wavs/<id>.<suffix>``: any format libsndfile reads (wav, flac, ogg,
...; :data:`AUDIO_SUFFIXES` in order of preference when an id has several files).

The index reads only metadata and audio *headers* (``soundfile.info``, plus a RIFF chunk
walk that catches truncated WAV files), never decodes audio, so the consumer can plan
an epoch before any producer has started; a manifest clip whose ``duration`` is given is
indexed from it, its file not even looked up (:data:`UNMEASURED`), and checked when a
producer reads it. Producers read no metadata: the leases carry what they need of each clip
(Dataset agreement, below).

The samples are columnar (:class:`SampleTable`, table.py): numpy arrays of the lengths,
durations, lines, speaker and language codes, and UTF-8 blobs with offsets of the ids,
texts, audio locators and units; a Sample is made only for the clip asked for, and the
consumer plans from the columns.

Every clip that cannot be used becomes a :class:`Rejection` with a precise reason
naming the file and the metadata line; the run records them in ``rejected.jsonl`` and
counts them in summary.json. Nothing a dataset holds makes indexing raise, except a
dataset that cannot be used at all (:class:`DatasetError`).

Index cache
-----------
A built index is stored (``data.index_cache``; see :func:`index_cache_file`) under a
key: a SHA-256 over the metadata bytes, the name, size and mtime of every audio file,
the config keys the index depends on (:func:`index_config`) and :data:`INDEX_FORMAT`.
The file (cache.py) is a SHA-256-checked msgpack header and sections, each with its xxh3-64
checksum: the table's columns and blobs (units equal to the texts, clip for clip, are not
stored twice) and its rows in id order (:meth:`SampleTable.id_order`, sorted once at build),
mapped read-only when loaded (the texts, audio locators and units, which are read a clip at a
time, are read from the file by ``pread`` instead: ``table.FileBlob``), and what a rebuild
reuses. A warm load hashes every section
of the file it uses from the mapping (~0.1 s a GB), letting the pages go as it goes. A
matching cache file is loaded instead of building (no header is read); a manifest's is
found without reading the manifest: by a digest of the config and the manifest's stamp
(:func:`storage.file_stamp`: its size and mtime here; at a URL its size and the version or
ETag the store gives, else its modification time; its content's SHA-256 only where a store
gives none of them) and a stat of the files it measured. A manifest whose stamp changed but
not its bytes is found by its content, before it is parsed. A local LJSpeech layout's is found
by its metadata file's stamp too, with a stat of the files of the clips rejected as missing
only: no listing of ``wavs/``; each clip's file size and mtime as indexed are columns of the
table (``FILE_COLUMNS``) that a lease carries, and a producer rejects a file changed or deleted
since (:func:`stamp_problem`) when it reads it. On any change the index is
derived again, reusing what is still valid: header facts of audio files whose name, size
and mtime are unchanged, and token counts of unchanged texts; only changed or new files
are read. A cache file that fails a checksum or cannot be parsed is ignored (logged) and
rebuilt from scratch. Headers are read by ``data.index_workers`` processes when the work
would outlast starting them (:data:`PARALLEL_MIN_SECONDS`); a helper's read retries are
counted with the index's (``IndexStats.read_retries``).

Dataset agreement
-----------------
No producer reads metadata of its own: its leases carry its clips' texts, audio locators and
durations. A producer the trainer's launcher starts on its host reads the trainer's own
files: its HELLO is :func:`deferred`, accepted as it is. A producer on another host reads its
own copy and joins as fast, whatever the size: its HELLO is :func:`describe_copy`, the
metadata file it was pointed at, its data.columns and :func:`metadata_sha256` (the file
hashed a piece at a time, never parsed; a mix's blob; for tar shards their names and byte
sizes, :func:`shards_sha256`). The trainer compares it with the SHA-256 its index stores
(:func:`fingerprints`, :attr:`DatasetIndex.agreement`; :class:`Reference`) and refuses
another metadata file with one line (:func:`check_agreement`). The audio is checked per file
when read: a lease to such a producer carries each file's byte size on the trainer
(:func:`file_sizes`), and a file there of another size (:func:`size_problem`) or absent is
*missed*, re-planned onto another producer.

The index also stores the trainer's :class:`DatasetScan` fingerprints, which name the dataset
(logs, checkpoints, the mel statistics' key) without parsing the metadata on a warm load:

    metadata  sha256 of ``id TAB text TAB speaker TAB language LF`` per metadata entry,
              sorted by id (line order, the unused middle column and malformed lines do
              not count)
    audio     sha256 of ``id TAB byte-size LF`` per audio file present, sorted by id

Paths and modification times are left out on purpose: a copy on another host lives
under another directory and ``cp``/``scp`` reset mtimes, yet it is the same data.

The package, one module per idea (each imports only those above it in this list):

    types.py       the records: Sample, AudioFile, AudioProbe, IndexStats, DatasetError
    table.py       the samples as columns (SampleTable)
    probe.py       audio headers without decoding (shared with producer/audio.py)
    storage.py     bytes of files here or at fsspec URLs (bounded read-ahead, counted retries)
    cache.py       the index cache: its place, key and file format
    parquet.py     Parquet files: their rows' listing (read as shards' through shards.py), row groups read
    shar.py        lhotse Shar directories: a shard's cuts matched to its recording tar's members
    shards.py      WebDataset-style tar shards: their listing as a manifest, each clip's locator
    files.py       where metadata and audio are (the directory, a mix file, each id's file, shards,
                   a manifest at a URL)
    agreement.py   what a host sees of a dataset, a producer's copy at joining and per file, the verdict
    parallel.py    the build's header and text reads, shared out to helper processes
    rules.py       what a clip must pass to be indexed, the rejections and lost characters
    indexed.py     the index as built (DatasetIndex), and every build's last step
    reuse.py       the index cache as a build uses it: found by a stamp, loaded, what a stale one holds
    pieces.py      one piece of a large manifest with durations, indexed as columns
    chunked.py     a large manifest's pieces indexed by helpers and merged
    parquet_pieces.py  a large Parquet dataset's row groups made pieces of a manifest
    index.py       building the index (build_index)

Everything public is importable from ``shared.dataset`` itself.
"""

from __future__ import annotations

from ..dataset.types import (AudioFile, AudioProbe, DEFAULT_SPEAKER, DatasetError, IndexStats, Sample)
from ..dataset.files import (AUDIO_DIR, AUDIO_SUFFIX, AUDIO_SUFFIXES, DEMO_DATA_DIR, UNMEASURED, audio_path,
                                  list_audio,
                                  locate, locate_audio, read_metadata, read_metadata_bytes, relative_audio,
                                  resolve_root, scan_audio)
from ..dataset.probe import (MAX_DETAIL_CHARS, RIFF_PROBE_BYTES, RIFF_UNKNOWN_SIZES, RiffFacts,
                                  expected_samples, libsndfile_message, probe_audio, riff_facts, riff_problem)
from ..dataset.agreement import (Agreement, DatasetScan, FINGERPRINT_HEX, HASH_CHUNK_BYTES, Reference,
                                      audio_fingerprint, check_agreement, deferred, describe_copy, file_sha256,
                                      file_sizes, fingerprints, is_deferred, metadata_fingerprint, metadata_sha256,
                                      scan_dataset, scan_from, shards_sha256, size_problem,
                                      stamp_problem)
from ..dataset.table import NUMBER_COLUMNS, STRING_COLUMNS, SampleTable, pack_strings
from ..dataset.cache import (CachedIndex, DATASET_CACHE_DIR, FEATURE_CACHE_AUTO, INDEX_CACHE_MAGIC, INDEX_CACHE_OFF,
                                  INDEX_FORMAT, PROBE_FIELDS, REJECTION_FIELDS, SECTION_ALIGN, UNITS_FIELDS,
                                  columns_of, feature_cache_dir, index_cache_file, index_config, index_key,
                                  mel_stats_file, open_index, pack_index, read_cache, rejections_of, user_cache_dir,
                                  write_cache)
from ..dataset.parallel import (CHUNK_ITEMS, FLAC_HEADER_S, Item, OTHER_HEADER_S, PARALLEL_MIN_SECONDS, PHONEMES_S,
                                PHONEME_CHUNK_ITEMS, TEXT_S, TextKey, WAV_HEADER_S)
from ..dataset.rules import KIND_HINTS, LostReport, MOSTLY_REJECTED_FRAC
from ..dataset.indexed import DatasetIndex
from ..dataset.index import build_index

__all__ = [
    "AUDIO_DIR", "AUDIO_SUFFIX", "AUDIO_SUFFIXES", "Agreement", "AudioFile", "AudioProbe", "CHUNK_ITEMS",
    "CachedIndex", "DATASET_CACHE_DIR", "DEFAULT_SPEAKER", "DEMO_DATA_DIR", "DatasetError", "DatasetIndex",
    "DatasetScan", "FEATURE_CACHE_AUTO", "FINGERPRINT_HEX", "FLAC_HEADER_S", "HASH_CHUNK_BYTES",
    "INDEX_CACHE_MAGIC", "INDEX_CACHE_OFF", "INDEX_FORMAT", "IndexStats", "Item", "KIND_HINTS", "LostReport",
    "MAX_DETAIL_CHARS", "MOSTLY_REJECTED_FRAC", "NUMBER_COLUMNS", "OTHER_HEADER_S", "PARALLEL_MIN_SECONDS",
    "PHONEMES_S", "PHONEME_CHUNK_ITEMS", "PROBE_FIELDS", "REJECTION_FIELDS", "RIFF_PROBE_BYTES",
    "RIFF_UNKNOWN_SIZES", "Reference", "RiffFacts", "SECTION_ALIGN", "STRING_COLUMNS", "Sample", "SampleTable",
    "TEXT_S", "TextKey", "UNITS_FIELDS", "UNMEASURED", "WAV_HEADER_S", "audio_fingerprint", "audio_path",
    "build_index", "check_agreement", "columns_of", "deferred", "describe_copy", "expected_samples",
    "feature_cache_dir", "file_sha256", "file_sizes", "fingerprints", "index_cache_file", "index_config", "index_key",
    "is_deferred", "libsndfile_message", "list_audio", "locate", "locate_audio", "mel_stats_file",
    "metadata_fingerprint", "metadata_sha256", "open_index", "pack_index", "pack_strings", "probe_audio",
    "read_cache", "read_metadata", "read_metadata_bytes", "rejections_of", "relative_audio", "resolve_root",
    "riff_facts", "riff_problem", "scan_audio", "scan_dataset", "scan_from", "shards_sha256", "size_problem",
    "stamp_problem", "user_cache_dir", "write_cache",
]
