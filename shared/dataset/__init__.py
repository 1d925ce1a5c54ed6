"""The dataset index: which clips exist, how long they are, and which were rejected.

A package of one module per idea; the index's names (:func:`build_index`, :class:`DatasetIndex`,
its records, files, headers, agreement and cache) are importable from here. The modules and
their order, the index's rules: docs/design/index.md; its columns and cache: docs/design/index.md,
"Index cache"; what a producer's copy must agree on: docs/design/protocol.md, "Dataset agreement".
"""

from __future__ import annotations

from ..dataset.types import (AudioFile, AudioProbe, DEFAULT_SPEAKER, DatasetError, IndexStats, Sample)
from ..dataset.files import (AUDIO_DIR, AUDIO_SUFFIX, AUDIO_SUFFIXES, DEMO_DATA_DIR, UNMEASURED, audio_path,
                             locate_audio, relative_audio, resolve_root, scan_audio)
from ..dataset.corpus.registry import locate, read_metadata
from ..dataset.storage import HASH_CHUNK_BYTES, file_sha256
from ..dataset.probe import (MAX_DETAIL_CHARS, RIFF_PROBE_BYTES, RIFF_UNKNOWN_SIZES, RiffFacts,
                                  expected_samples, libsndfile_message, probe_audio, riff_facts, riff_problem)
from ..dataset.agreement import (Agreement, DatasetScan, FINGERPRINT_HEX, Reference,
                                      audio_fingerprint, check_agreement, deferred, describe_copy,
                                      file_sizes, fingerprints, is_deferred, metadata_fingerprint, metadata_sha256,
                                      scan_dataset, scan_from, size_problem,
                                      stamp_problem)
from ..dataset.table import NUMBER_COLUMNS, STRING_COLUMNS, SampleTable, pack_strings
from ..dataset.cache import (CachedIndex, DATASET_CACHE_DIR, FEATURE_CACHE_AUTO, INDEX_CACHE_MAGIC, INDEX_CACHE_OFF,
                                  INDEX_FORMAT, PROBE_FIELDS, REJECTION_FIELDS, SECTION_ALIGN, UNITS_FIELDS,
                                  columns_of, feature_cache_dir, index_cache_file, index_config, index_key,
                                  mel_stats_file, open_index, read_cache, rejections_of, user_cache_dir,
                                  write_cache, write_index)
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
    "is_deferred", "libsndfile_message", "locate", "locate_audio", "mel_stats_file",
    "metadata_fingerprint", "metadata_sha256", "open_index", "pack_strings", "probe_audio",
    "read_cache", "read_metadata", "rejections_of", "relative_audio", "resolve_root",
    "riff_facts", "riff_problem", "scan_audio", "scan_dataset", "scan_from", "size_problem",
    "stamp_problem", "user_cache_dir", "write_cache", "write_index",
]
