"""Generate the embedded demo dataset (LJSpeech layout) with espeak-ng and sox.

Usage::

    python data/make_demo.py data/demo

writes ``<out>/metadata.csv`` (``id|text|normalized_text``, ids ``DEMO-0001`` ...) and
``<out>/wavs/<id>.wav`` (22050 Hz, mono, 16-bit PCM, 1.5 to 5 s each).

Requirements: the ``espeak-ng`` and ``sox`` command-line tools (Debian: ``apt-get
install espeak-ng sox``), plus numpy and soundfile. Only maintainers regenerating the
set need them: the output in ``data/demo/`` is committed, so users and CI need neither.

The output is deterministic for given espeak-ng and sox versions (no random choices;
sox runs in repeatable mode without dither, and the final files are rewritten by
soundfile so the WAV header is canonical). The sentences were written for this project.

Each sentence is spoken with a voice and a speed taken from fixed cycles (several
espeak-ng English voices and variants, 140 to 180 words per minute) so that the set is
not monotonous; leading and trailing silence is trimmed to a short fixed margin.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import soundfile as sf

logger = logging.getLogger("make_demo")

SAMPLE_RATE_HZ = 22050  # LJSpeech's rate, and FeaturesConfig's default
MIN_DURATION_S = 1.5  # shortest clip we accept (the tests check the same bounds)
MAX_DURATION_S = 5.0  # longest clip: keeps the set small and the batches short
MAX_TOTAL_BYTES = 7_000_000  # the whole set (wavs and metadata) must stay small enough to commit
LEAD_SILENCE_S = 0.05  # silence kept before speech after trimming
TRAIL_SILENCE_S = 0.1  # silence kept after speech after trimming
SILENCE_THRESHOLD = "0.1%"  # sox `silence` level below which audio counts as silent

# espeak-ng voices and variants, cycled over the sentences (accents, male and female).
VOICES: tuple[str, ...] = (
    "en-us", "en-gb", "en+m3", "en+f2", "en-us+f3", "en-gb-x-rp+m1", "en-gb-scotland+f4", "en-us+m5",
)
# Speaking rates in words per minute, cycled with a stride so voice and speed vary
# independently.
SPEEDS_WPM: tuple[int, ...] = (140, 150, 160, 170, 180)
SPEED_STRIDE = 3  # coprime with len(SPEEDS_WPM): every speed meets every voice

# (text, normalized_text). Written for this project. As in LJSpeech, `text` may contain
# digits and abbreviations and `normalized_text` spells them out; the audio speaks the
# normalized text.
SENTENCES: tuple[tuple[str, str], ...] = (
    ("The kettle whistled at noon.", ""),
    ("A gentle rain fell over the square.", ""),
    ("The hallway clock stopped at midnight.", ""),
    ("Fresh bread was cooling on the windowsill while the children waited for breakfast.", ""),
    ("She painted the fence pale green.", ""),
    ("The children counted the stars.", ""),
    ("Dr. Patel opened the clinic on Monday.", "Doctor Patel opened the clinic on Monday."),
    ("Our neighbour grows tomatoes by the wall.", ""),
    ("The river was calm, and we could see every stone on the bottom.", ""),
    ("He folded the map carefully.", ""),
    ("Geese crossed the grey sky.", ""),
    ("The bridge was finished in 1998.", "The bridge was finished in nineteen ninety-eight."),
    ("The library smells of old paper.", ""),
    ("Please close the window before the storm arrives.", ""),
    ("Snow covered the hills all winter.", ""),
    ("The cat watched the birds.", ""),
    ("Mr. Hale keeps 12 goats.", "Mister Hale keeps twelve goats."),
    ("Every lamp on the street flickered.", ""),
    ("The farmer mended the gate with wire he found in the old shed.", ""),
    ("We walked along the beach.", ""),
    ("The soup needs more salt.", ""),
    ("A small boat drifted toward the harbour.", ""),
    ("The train leaves at 7:15.", "The train leaves at seven fifteen."),
    ("Nobody noticed the letter under the doormat.", ""),
    ("The wind smelled of pine.", ""),
    ("He played a quiet song.", ""),
    ("The bus was late again this morning.", ""),
    ("St. Mary's Church was rebuilt in 1904.", "Saint Mary's Church was rebuilt in nineteen oh four."),
    ("Yellow leaves covered the path, and the air smelled of smoke and rain.", ""),
    ("She kept her recipes in a box.", ""),
    ("Thunder rolled over the mountains.", ""),
    ("The parcel weighed 3.5 kilograms.", "The parcel weighed three point five kilograms."),
    ("Workers painted lines on the road.", ""),
    ("A lighthouse stands alone at the edge of the cliff.", ""),
    ("Can you hear the church bells?", ""),
    ("About 40% of the seeds sprouted.", "About forty percent of the seeds sprouted."),
    ("The fox slipped through the hedge.", ""),
    ("Warm light spilled from the inn.", ""),
    ("The garden gate creaks whenever the wind blows.", ""),
    ("The museum on 5th Ave. closes early.", "The museum on Fifth Avenue closes early."),
    ("He carried the boxes upstairs.", ""),
    ("The apples were crisp and sweet.", ""),
    ("A narrow path winds down to the shore.", ""),
    ("Prof. Lind spoke to 250 students.", "Professor Lind spoke to two hundred fifty students."),
    ("The guard checked every ticket twice.", ""),
    ("They planted oak trees by the school.", ""),
    ("The candle burned down while she read.", ""),
    ("What a lovely view from the hill!", ""),
    ("The recipe calls for 2 cups of flour.", "The recipe calls for two cups of flour."),
    ("The fisherman repaired his nets.", ""),
    ("Fog hid the far shore.", ""),
    ("The old piano was out of tune.", ""),
    ("The 3rd floor is closed today.", "The third floor is closed today."),
    ("Our train crossed the border at sunrise, while most passengers were still asleep.", ""),
    ("The puppy chased its tail.", ""),
    ("Capt. Reyes sailed 1,200 miles in 9 days.", "Captain Reyes sailed twelve hundred miles in nine days."),
    ("She measured the room before buying a carpet.", ""),
    ("Quiet streets; closed shops: the town was asleep.", ""),
    ("The mail arrived early, and the news was good.", ""),
    ("Mrs. Okafor turned 80 on the 1st of May.", "Missus Okafor turned eighty on the first of May."),
    ("Is the bakery still open?", ""),
    ("The hikers rested by a cold stream.", ""),
    ("A red kite circled above the field.", ""),
    ("The ferry crossed the bay in twenty minutes.", ""),
)


def _rows() -> list[tuple[str, str, str]]:
    """(id, text, normalized_text) for every sentence; empty normalized means same as text."""
    return [(f"DEMO-{i + 1:04d}", text, normalized or text) for i, (text, normalized) in enumerate(SENTENCES)]


def _require_tools() -> None:
    missing = [tool for tool in ("espeak-ng", "sox") if shutil.which(tool) is None]
    if missing:
        raise SystemExit(f"make_demo needs {' and '.join(missing)} on PATH (Debian: apt-get install espeak-ng sox)")


def _synthesise(text: str, voice: str, speed_wpm: int, out_path: Path, tmp_dir: Path) -> float:
    """Speak ``text`` into ``out_path`` (22050 Hz mono PCM_16); return its duration in s."""
    raw = tmp_dir / "espeak.wav"
    trimmed = tmp_dir / "sox.wav"
    subprocess.run(["espeak-ng", "-v", voice, "-s", str(speed_wpm), "-w", str(raw), text],
                   check=True, capture_output=True)
    subprocess.run(
        ["sox", "-R", "-D", str(raw), "-r", str(SAMPLE_RATE_HZ), "-c", "1", "-b", "16", "-e", "signed-integer",
         str(trimmed),
         "silence", "1", "0.01", SILENCE_THRESHOLD, "reverse", "silence", "1", "0.01", SILENCE_THRESHOLD, "reverse",
         "pad", str(LEAD_SILENCE_S), str(TRAIL_SILENCE_S)],
        check=True, capture_output=True)
    samples, rate = sf.read(str(trimmed), dtype="int16", always_2d=False)
    if rate != SAMPLE_RATE_HZ or samples.ndim != 1:
        raise RuntimeError(f"sox produced {rate} Hz with shape {samples.shape} for {out_path.name}")
    sf.write(str(out_path), np.ascontiguousarray(samples), SAMPLE_RATE_HZ, subtype="PCM_16", format="WAV")
    return samples.shape[0] / SAMPLE_RATE_HZ


def make_demo(out_dir: Path) -> None:
    """Write metadata.csv and wavs/ under ``out_dir`` (existing demo files are overwritten)."""
    _require_tools()
    wav_dir = out_dir / "wavs"
    wav_dir.mkdir(parents=True, exist_ok=True)
    rows = _rows()
    total_bytes = 0
    total_s = 0.0
    with tempfile.TemporaryDirectory(prefix="make_demo_") as tmp:
        for index, (clip_id, _text, normalized) in enumerate(rows):
            voice = VOICES[index % len(VOICES)]
            speed = SPEEDS_WPM[(index * SPEED_STRIDE) % len(SPEEDS_WPM)]
            wav_path = wav_dir / f"{clip_id}.wav"
            duration = _synthesise(normalized, voice, speed, wav_path, Path(tmp))
            if not MIN_DURATION_S <= duration <= MAX_DURATION_S:
                raise RuntimeError(f"{clip_id} lasts {duration:.2f} s, outside [{MIN_DURATION_S}, {MAX_DURATION_S}]: "
                                   f"edit the sentence {normalized!r}")
            total_bytes += wav_path.stat().st_size
            total_s += duration
            logger.info("%s %5.2f s  %-20s %3d wpm  %s", clip_id, duration, voice, speed, normalized)
    metadata = "".join(f"{clip_id}|{text}|{normalized}\n" for clip_id, text, normalized in rows)
    (out_dir / "metadata.csv").write_text(metadata, encoding="utf-8", newline="\n")
    total_bytes += len(metadata.encode("utf-8"))
    logger.info("%d clips, %.1f s of audio, %.2f MB", len(rows), total_s, total_bytes / 1e6)
    if total_bytes > MAX_TOTAL_BYTES:
        raise RuntimeError(f"the demo set is {total_bytes} bytes, over the {MAX_TOTAL_BYTES} byte budget")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path, help="output directory, e.g. data/demo")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    make_demo(args.out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
