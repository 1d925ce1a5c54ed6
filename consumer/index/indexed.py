"""The index as a build returns it (DatasetIndex): its samples, rejections, vocabulary and
fingerprints; and the last step every build takes (logging what it found, refusing a dataset
with no usable clip or one that a single cause mostly rejected).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...shared.config import DataConfig
from ...shared.dataset.agreement import DatasetScan, scan_dataset, scan_from
from .rules import mostly_rejected
from ...shared.dataset.table import SampleTable
from ...shared.dataset.types import AudioFile, DatasetError, IndexStats, Sample
from ...shared.dataset.layouts import COLUMNS_AUTO, Rejection
from ...shared.vocab import Vocabulary

log = logging.getLogger(__name__)


@dataclass
class DatasetIndex:
    """The usable samples and the rejections of a dataset.

    ``fingerprint`` is the index cache key (it tracks the config too); ``scan`` is the
    dataset as seen on this host (its fingerprints: :attr:`dataset_fingerprint`), derived on
    first use from the metadata bytes and audio listing the index was built from (a warm
    cache load does not pay for parsing the metadata unless a scan is wanted; a manifest is
    read again then, rather than held through the run).
    """

    root: Path
    samples: SampleTable  # a sequence of Sample, columnar (shared/dataset/table.py)
    rejected: list[Rejection]
    fingerprint: str
    stats: IndexStats = field(default_factory=IndexStats)
    metadata_file: str = "metadata.csv"
    columns: str = COLUMNS_AUTO
    vocabulary: Vocabulary | None = None  # None only for indexes made without a front-end (tests)
    lost: dict[str, Any] = field(default_factory=dict)  # lost characters: see LostReport.to_json
    # The scan's fingerprints and the metadata's SHA-256, stored with the index
    # (agreement.fingerprints): a warm load has them without parsing the metadata; a producer on
    # another host is checked against the SHA-256 (agreement.Reference).
    agreement: dict[str, Any] = field(default_factory=dict)
    _scan: DatasetScan | None = field(default=None, repr=False)
    _scan_inputs: tuple[bytes, dict[str, AudioFile]] | None = field(default=None, repr=False)

    @property
    def scan(self) -> DatasetScan:
        if self._scan is None:
            if self._scan_inputs is not None:
                metadata, audio = self._scan_inputs
                self._scan = scan_from(self.root, self.metadata_file, metadata, audio, self.columns)
                self._scan_inputs = None
            else:
                self._scan = scan_dataset(self.root, self.metadata_file, self.columns)
        return self._scan

    @property
    def dataset_fingerprint(self) -> str:
        """The metadata and audio fingerprints as one short string (DatasetScan.fingerprint), for
        logs, summary.json, checkpoints and the mel statistics' key."""
        if not self.agreement:
            return self.scan.fingerprint
        return f"{self.agreement['metadata'][:8]}{self.agreement['audio'][:8]}"

    def by_id(self) -> dict[str, Sample]:
        return {s.id: s for s in self.samples}

    def sample(self, sample_id: str) -> Sample:
        """One clip by id (KeyError when the index has none)."""
        return self.samples[self.samples.row_of(sample_id)]


def finished_index(root: Path, samples: SampleTable, rejected: list[Rejection], lost: dict[str, Any],
                   agreed: dict[str, Any], vocab: Vocabulary, key: str, stats: IndexStats, started: float, log_rejections: bool,
                   scan_inputs: tuple[str, bytes, dict[str, AudioFile]] | None, data: DataConfig) -> DatasetIndex:
    stats.seconds = time.perf_counter() - started
    if log_rejections:
        for r in rejected:
            log.warning("rejected %s: %s", r.id, r.reason)
    if lost.get("chars"):
        shown = ", ".join(f"{c['char']!r} {c['code']} ({c['count']}x in {c['clips']} clips, e.g. "
                          f"{', '.join(c['examples'])})" for c in lost["chars"][:8])
        log.warning("%d clips of %s lose characters the %s front-end cannot represent: %s", lost["clips"], root,
                    vocab.frontend, shown)
    log.info("index of %s: %d clips usable, %d rejected (cache %s, %d headers read, %d reused, %d texts through "
             "the front-end, %d worker(s), %.2f s)", root, len(samples), len(rejected), stats.cache,
             stats.headers_read, stats.headers_reused, stats.texts_tokenized, stats.workers, stats.seconds)
    cause = mostly_rejected(len(samples) + len(rejected), rejected)
    if not samples:
        raise DatasetError(f"dataset {root} has no usable clip ({len(rejected)} rejected)"
                           + (f": {cause}" if cause else ""))
    if cause:
        raise DatasetError(f"dataset {root}: {cause}")
    return DatasetIndex(root=root, samples=samples, rejected=rejected, fingerprint=key[:16], stats=stats,
                        metadata_file=data.metadata_file, columns=data.columns, vocabulary=vocab, lost=lost,
                        agreement=agreed, _scan_inputs=scan_inputs[1:] if scan_inputs is not None else None)

