"""The run's clip list: every clip a run knows, by position, as the ``clip`` batch field names it.

A position is the clip's row in the dataset's index (``index.samples``), then, past those, the
clips of ``data.eval_file`` that the index lacks, in the held-out order. The list says what
each clip is (id, text, what the front-end made of it, token ids, audio locator, speaker,
language, duration) and which clips an epoch's plan trains, so that a loop can log a
per-clip loss or check what it trained without redoing the text front-end
(docs/FEED.md, Every row known).
"""

from __future__ import annotations

from typing import NamedTuple, Sequence, overload

import numpy as np

from .prepared import PreparedRun


class Clip(NamedTuple):
    """One clip of the run's clip list."""

    position: int  # in the clip list: the ``clip`` batch field's value for its row
    id: str
    text: str  # the metadata's text as the index read it (normalized_text where the metadata has it)
    units: str  # what the text front-end made of it (the normalised text, or phonemes): the tokens spell these
    tokens: np.ndarray  # the token ids a batch row of it carries (int32, EOS included)
    audio: str  # its audio: the file under the dataset, tar member or URL, as the index located it
    speaker: str  # its speaker's name (the speaker_id field: vocabulary.speaker_id(name))
    language: str  # its language code (the language_id field: vocabulary.language_id(code))
    duration_s: float
    held_out: bool  # a validation clip (feed.validation()), never in a training epoch


class ClipList(Sequence[Clip]):
    """The clip list of a prepared run (module docstring)."""

    def __init__(self, prepared: PreparedRun) -> None:
        self._prepared = prepared
        self._index = prepared.index.samples
        self._extra = {p: s for p, s in zip(prepared.val_positions, prepared.val_samples) if p >= len(self._index)}
        self._held = frozenset(prepared.val_positions)

    def __len__(self) -> int:
        return len(self._index) + len(self._extra)

    @overload
    def __getitem__(self, position: int) -> Clip: ...

    @overload
    def __getitem__(self, position: slice) -> list[Clip]: ...

    def __getitem__(self, position: int | slice) -> Clip | list[Clip]:
        if isinstance(position, slice):
            return [self[p] for p in range(*position.indices(len(self)))]
        position = int(position)
        if position < 0:
            raise IndexError(f"clip position {position}: -1 is an empty row's, which holds no clip")
        if position >= len(self):
            raise IndexError(f"clip position {position}: the run has {len(self)} clips")
        sample = self._index[position] if position < len(self._index) else self._extra[position]
        return Clip(position, sample.id, sample.text, sample.units, self._prepared.vocabulary.encode(sample.units),
                    sample.audio, sample.speaker, sample.language, sample.duration_s, position in self._held)

    def position(self, clip_id: str) -> int:
        """The position of clip ``clip_id``; KeyError when the run has no such clip."""
        (row,) = self._index.find_rows([clip_id])
        if row >= 0:
            return row
        for position, sample in self._extra.items():
            if sample.id == clip_id:
                return position
        raise KeyError(clip_id)

    def epoch(self, epoch: int) -> np.ndarray:
        """The positions of the clips training epoch ``epoch`` is planned to train, in the plan's
        order (each once; with several trainer workers, this worker's share). A clip a producer
        rejects while the run goes on is not trained (rejected.jsonl says why)."""
        planner = self._prepared.planner
        return planner.table.stored_rows(planner.plan(epoch).order())

    @property
    def validation(self) -> list[int]:
        """The positions of the held-out clips (feed.validation()'s), in feed.validation_clips' order."""
        return list(self._prepared.val_positions)


__all__ = ["Clip", "ClipList"]
