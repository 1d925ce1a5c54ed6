"""What a lease carries for its clips beside their ids, read from the trainer's index by row.

Token ids, speakers, languages, texts, audio locators and file stamps (:class:`TokenTable`),
and each clip's reference clip for the ``ref_mel`` field (:class:`ReferenceTable`): the
trainer tokenizes and chooses, so a producer reads no metadata (docs/design/protocol.md,
"Text and vocabulary", "Dataset agreement").
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any, Sequence

import numpy as np

from ..plan import as_table
from ...shared.dataset.files import UNMEASURED
from ...shared.dataset.types import Sample
from ...shared.vocab import Vocabulary

log = logging.getLogger(__name__)


class ReferenceTable:
    """The reference clip of each planned clip, for the ``ref_mel`` batch field: another clip
    of the same speaker, chosen per epoch by a pure function of (seed, epoch, clip id), so a
    re-planned or resumed batch gets the same reference and each epoch another one. A
    speaker with one clip is its own reference (logged once, with the count)."""

    def __init__(self, samples: Sequence[Sample], seed: int) -> None:
        self.seed = seed
        table = self._table = as_table(samples)
        count = len(table)
        speaker = self._speaker = table.column("speaker")  # read once: a view's column is a copy
        # Each speaker's clips ordered by id, as positions in the table; each clip's rank among them.
        order = table.id_order()
        order = order[np.argsort(speaker[order], kind="stable")]
        starts = np.searchsorted(speaker[order], np.arange(len(table.speakers) + 1))
        self._clips = order
        self._start = starts  # the clips of speaker code c: order[starts[c]:starts[c + 1]]
        self._rank = np.empty(count, np.int64)
        self._rank[order] = np.arange(count) - starts[speaker[order]]
        alone = [table.speakers[c] for c in range(len(table.speakers)) if starts[c + 1] - starts[c] == 1]
        if alone:
            log.info("ref_mel: %d speaker(s) have one clip, which is its own reference (%s)", len(alone),
                     ", ".join(alone[:5]))

    def __call__(self, epoch: int, ids: Sequence[str], clips: Sequence[int] | None = None) -> list[str]:
        """The reference clip id of each of ``ids`` in ``epoch``; ``clips``: their table rows,
        where the caller has them (else looked up)."""
        refs = []
        speakers = self._speaker
        rows = clips if clips is not None and len(clips) == len(ids) else self._table.find_rows(list(ids))
        for sample_id, row in zip(ids, rows):
            if row < 0:
                raise KeyError(sample_id)
            code = speakers[row]
            first, count = int(self._start[code]), int(self._start[code + 1] - self._start[code])
            if count == 1:
                refs.append(sample_id)
                continue
            position = int(self._rank[row])
            digest = hashlib.sha256(f"{self.seed}:{epoch}:{sample_id}".encode()).digest()
            k = int.from_bytes(digest[:8], "little") % (count - 1)  # any clip of the speaker but itself
            refs.append(self._table.string("id", int(self._clips[first + (k if k < position else k + 1)])))
        return refs


class TokenTable:
    """The token ids of each planned sample, as its lease carries them to a producer.

    The trainer tokenizes (its index holds each text's units, made once by the text
    front-end and cached), so a producer, here or on another host, needs no front-end,
    phonemizer or vocabulary of its own, and its tokens cannot differ from the index's.
    """

    def __init__(self, samples: Sequence[Sample], vocabulary: Vocabulary,
                 positions: Sequence[int] | None = None) -> None:
        self.vocabulary = vocabulary
        self._table = as_table(samples)
        # Each row's position in the run's clip list (the ``clip`` batch field): ``positions``, else the
        # row in the whole table this one is a view of (the index's, from which a hold-out is taken).
        self._positions = np.asarray(positions, np.int64) if positions is not None else None
        speakers = {name: n for n, name in enumerate(vocabulary.speakers)}
        languages = {code: n for n, code in enumerate(vocabulary.languages)}
        # The table's speaker and language codes as the vocabulary's ids.
        self._speakers = [speakers.get(name, 0) for name in self._table.speakers]
        self._languages = [languages.get(code, 0) for code in self._table.languages]
        # Read once: a view's column is a copy, and every lease reads them.
        self._columns = tuple(self._table.column(n) for n in ("speaker", "language", "duration_s"))
        # Each clip's audio file as indexed (size, mtime), where the index listed them (table.FILE_COLUMNS).
        self._stamps = ((self._table.column("file_size"), self._table.column("file_mtime_ns"))
                        if self._table.has("file_size") else None)

    def __call__(self, ids: Sequence[str]) -> list[list[int]]:
        return [self.vocabulary.encode(self._table.string("units", r)).tolist() for r in self._rows(ids)]

    def _rows(self, ids: Sequence[str], clips: Sequence[int] | None = None) -> Sequence[int]:
        """The table rows of ``ids``: ``clips`` where the caller has them, else looked up."""
        if clips is not None and len(clips) == len(ids):
            return clips
        rows = self._table.find_rows(ids)
        if min(rows, default=0) < 0:
            raise KeyError(ids[rows.index(-1)])
        return rows

    def files(self, ids: Sequence[str]) -> dict[str, str]:
        """The audio locators of clips ``ids`` the table holds (a validation clip's reference may be
        one it lacks: the validation set names those)."""
        table = self._table
        if not ids:  # no lookup: the first would map every id of the table
            return {}
        return {i: table.string("audio", r) for i, r in zip(ids, table.find_rows(ids)) if r >= 0}

    def lease_fields(self, ids: Sequence[str], clips: Sequence[int] | None = None) -> dict[str, Any]:
        """What a lease carries for its clips: token ids, speaker ids, language ids, their
        positions in the run's clip list, and their
        texts, audio locators and durations ({id: ...}), so that a producer reads no metadata; and
        the size and mtime of each clip's audio file as indexed ({id: [size, mtime_ns]}: a file the
        index listed), which a producer on the trainer's host checks its file against when it reads
        it (agreement.stamp_problem). ``clips``: their table rows, where the caller has them."""
        table = self._table
        rows = self._rows(ids, clips)
        speaker, language, duration = self._columns
        stamps = None
        if self._stamps is not None:
            size, mtime = self._stamps
            stamps = {i: [int(size[r]), int(mtime[r])] for i, r in zip(ids, rows) if size[r] != UNMEASURED}
        return {"tokens": [self.vocabulary.encode(table.string("units", r)).tolist() for r in rows],
                "speakers": [self._speakers[speaker[r]] for r in rows],
                "languages": [self._languages[language[r]] for r in rows],
                "texts": {i: table.string("text", r) for i, r in zip(ids, rows)},
                "files": {i: table.string("audio", r) for i, r in zip(ids, rows)},
                "durations": tuple(float(duration[r]) for r in rows), "stamps": stamps or None,
                "positions": tuple(self.positions(rows).tolist())}

    def positions(self, rows: Sequence[int]) -> np.ndarray:
        """The clip list positions of table rows ``rows`` (TokenTable's ``positions``)."""
        if self._positions is not None:
            return self._positions[np.asarray(rows, np.int64)]
        return self._table.stored_rows(rows)

