"""The rules a clip passes to be indexed: its text through the front-end (lost characters, token
count, the run's tables), its audio (present, readable, of a usable duration); the rejections
they make, the lost-character report, and the one line naming a cause that took most clips.
"""

from __future__ import annotations

import collections
import unicodedata
from typing import Any, Sequence

from ...shared.config import DataConfig, FeaturesConfig, TextConfig
from ...shared.dataset.files import UNMEASURED, relative_audio
from .parallel import TextKey
from ...shared.dataset.probe import expected_samples
from ...shared.dataset.types import AudioFile, AudioProbe, DEFAULT_SPEAKER, Sample
from ...shared.dataset.layouts import Entry, Rejection
from ...shared.mel import min_num_samples, num_frames
from ...shared.text import LANGUAGES, LOST_EXAMPLES, Frontend, Units
from ...shared.vocab import Vocabulary


# A dataset where more than this share of the clips is rejected for one cause ends the run
# with one line naming the cause and the setting that fixes it (a wrong front-end,
# language or column mapping rejects nearly everything).
MOSTLY_REJECTED_FRAC = 0.5


def vocabulary_of(frontend: Frontend, samples: Sequence[Sample]) -> Vocabulary:
    return Vocabulary.build(frontend, (s.units for s in samples), (s.language for s in samples),
                            (s.speaker for s in samples))


# Rejection kinds (Rejection.kind): the cause shared by many clips of a dataset, and what fixes it.
KIND_HINTS = {
    "lost-text": "the text front-end cannot represent its text: check --language, --text-frontend, or allow "
                 "some loss with --set text.max_lost_frac=F",
    "empty-text": "its text is empty after normalisation: check data.columns (which field is the text) and "
                  "--language",
    "language": "its language is unknown: check the language column (data.columns) or --language",
    "vocabulary": "its language or speaker is not in the run's tables: resume only with the run's dataset",
    "too-many-tokens": "its text is longer than data.max_tokens allows: raise --set data.max_tokens=N",
    "missing-audio": "its audio file is missing: check --data (DIR/wavs/ID.wav) or the manifest's paths",
    "unreadable-audio": "its audio file cannot be read",
    "duration": "its duration is outside data.min_audio_s..data.max_audio_s",
}


def apply_rules(entries: list[Entry], rejected: list[Rejection], audio: dict[str, AudioFile],
                probes: dict[str, AudioProbe], units: dict[TextKey, Units], data: DataConfig,
                features: FeaturesConfig, text: TextConfig, frontend: Frontend,
                fixed: Vocabulary | None) -> tuple[list[Sample], list[Rejection], dict[str, Any]]:
    """Turn parsed metadata, header facts and units into samples, rejections and the lost-character report."""
    rejected = list(rejected)
    samples: list[Sample] = []
    report = LostReport()
    for entry in entries:
        said = text_rules(entry, units, data, text, frontend, fixed, report)
        if isinstance(said, Rejection):
            rejected.append(said)
            continue
        heard = audio_rules(entry, audio, probes, data, features)
        if isinstance(heard, Rejection):
            rejected.append(heard)
            continue
        made, count, code, speaker = said
        name, n, duration = heard
        samples.append(Sample(entry.id, entry.text, count, num_frames(n, features), duration, name,
                              entry.line, code, speaker, made.units))
    return samples, rejected, report.to_json()


def text_rules(entry: Entry, units: dict[TextKey, Units], data: DataConfig, text: TextConfig, frontend: Frontend,
               fixed: Vocabulary | None, report: "LostReport") -> Rejection | tuple[Units, int, str, str]:
    """A clip's text: (its units, token count, language, speaker), or why it is rejected."""
    place = f"metadata line {entry.line}"
    code = entry.language or text.language
    speaker = entry.speaker or DEFAULT_SPEAKER
    made = units.get((code, entry.text))
    if made is None:  # only a language outside LANGUAGES is never sent to the front-end
        return Rejection(entry.id, f"unknown language code {code!r} ({place}; known: "
                                   f"{', '.join(sorted(LANGUAGES))})", line=entry.line, kind="language")
    if fixed is not None:
        missing = fixed.missing(made.units)
        if missing:
            made = Units("".join(ch for ch in made.units if ch not in missing), made.lost + missing)
        if code not in fixed.languages or speaker not in fixed.speakers:
            what = f"language {code!r}" if code not in fixed.languages else f"speaker {speaker!r}"
            return Rejection(entry.id, f"{what} is not in the run's tables ({place})", line=entry.line,
                             kind="vocabulary")
    if made.lost:
        report.add(entry.id, made.lost)
        if made.lost_frac > text.max_lost_frac:
            shown = ", ".join(f"{ch!r} U+{ord(ch):04X}" for ch in dict.fromkeys(made.lost))
            return Rejection(entry.id, f"text loses {len(made.lost)} of {len(made.lost) + len(made.units)} "
                                       f"characters the {text.frontend} front-end cannot represent "
                                       f"({shown}; text.max_lost_frac={text.max_lost_frac:g}) ({place})",
                             line=entry.line, kind="lost-text")
    count = frontend.count(made.units)
    if count == 0:
        detail = ": nothing left after normalisation" if entry.text else ""
        return Rejection(entry.id, f"empty text on {place}{detail}", line=entry.line, kind="empty-text")
    if count > data.max_tokens:
        return Rejection(entry.id, f"text of {count} tokens exceeds data.max_tokens={data.max_tokens} ({place})",
                         line=entry.line, kind="too-many-tokens")
    return made, count, code, speaker


def audio_rules(entry: Entry, audio: dict[str, AudioFile], probes: dict[str, AudioProbe], data: DataConfig,
                features: FeaturesConfig) -> Rejection | tuple[str, int, float]:
    """A clip's audio: (its file name, samples at the feature rate, seconds), or why it is rejected."""
    place = f"metadata line {entry.line}"
    file = audio.get(entry.id) if entry.duration is None else AudioFile(entry.audio, UNMEASURED, UNMEASURED)
    if file is None:
        where = relative_audio(entry.id, entry.audio or None)
        if entry.short:  # no clip by that id: the line lost a field, and its first is not an id
            return Rejection(entry.id, f"malformed metadata line {entry.line}: {entry.short}: a field is missing "
                                       f"(read as id|text, its id has no audio file {where})", line=entry.line)
        return Rejection(entry.id, f"audio file missing: {where} ({place})", line=entry.line, file=where,
                         kind="missing-audio")
    where = relative_audio(entry.id, file.name)
    if entry.duration is not None:  # a manifest's: the audio is not looked at (checked when a producer reads it)
        duration = entry.duration
        frames, rate = round(duration * features.sample_rate_hz), features.sample_rate_hz
    else:
        probe = probes[file.name]
        if probe.error:
            detail = f": {probe.detail}" if probe.detail else ""
            return Rejection(entry.id, f"{probe.error}: {where}{detail} ({place})", line=entry.line, file=where,
                             kind="unreadable-audio")
        duration, frames, rate = probe.frames / probe.rate, probe.frames, probe.rate
    if duration > data.max_audio_s or duration < data.min_audio_s:
        bound = (f"longer than data.max_audio_s={data.max_audio_s:g}" if duration > data.max_audio_s
                 else f"shorter than data.min_audio_s={data.min_audio_s:g}")
        return Rejection(entry.id, f"clip of {duration:.2f} s {bound} s: {where} ({place})", line=entry.line,
                         file=where, kind="duration")
    n = expected_samples(frames, rate, features.sample_rate_hz)
    shortest = min_num_samples(features)  # the framing's shortest clip (shared/mel.py)
    if n < shortest:
        return Rejection(entry.id, f"clip of {n} samples at {features.sample_rate_hz} Hz is shorter than the "
                                   f"{shortest} its framing needs (features.padding {features.padding}): {where} "
                                   f"({place})", line=entry.line, file=where,
                         kind="duration")
    return file.name, n, duration


class LostReport:
    """Characters a front-end could not represent, per dataset: occurrences, clips, example ids."""

    def __init__(self) -> None:
        self.chars: dict[str, list[Any]] = {}  # char -> [occurrences, clips, example ids]
        self.clips = 0

    def add(self, sample_id: str, lost: str) -> None:
        self.clips += 1
        for ch, n in collections.Counter(lost).items():
            row = self.chars.setdefault(ch, [0, 0, []])
            row[0] += n
            row[1] += 1
            if len(row[2]) < LOST_EXAMPLES:
                row[2].append(sample_id)

    def to_json(self) -> dict[str, Any]:
        """``{"clips": N, "chars": [{"char", "code", "name", "count", "clips", "examples"}, ...]}``, most first."""
        rows = sorted(self.chars.items(), key=lambda kv: (-kv[1][0], kv[0]))
        return {"clips": self.clips, "chars": [
            {"char": ch, "code": f"U+{ord(ch):04X}", "name": unicodedata.name(ch, "").lower(), "count": count,
             "clips": clips, "examples": examples} for ch, (count, clips, examples) in rows]}


def mostly_rejected(entries: int, rejected: Sequence[Rejection]) -> str:
    """One line naming the cause when one kind of rejection took most of the dataset, else ""."""
    kinds = collections.Counter(r.kind for r in rejected if r.kind)
    if not kinds or entries <= 0:
        return ""
    kind, count = kinds.most_common(1)[0]
    if count <= MOSTLY_REJECTED_FRAC * entries:
        return ""
    example = next(r for r in rejected if r.kind == kind)
    return (f"{count} of {entries} clips were rejected because {KIND_HINTS[kind]} (e.g. {example.id}: "
            f"{example.reason})")

