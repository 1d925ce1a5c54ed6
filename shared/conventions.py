"""The feature definitions of the codebases TTS users train with, by name (``features.convention``).

Each convention is the settings (``features.*``, and the ``transforms.*`` its data loading
applies) that reproduce that codebase's mel function, at its own sample rate: the file and
function each one follows is named beside it, and tests/shared/test_conventions.py checks each
against that function (or, where its package cannot be installed beside stoker, against that
function's formula). A convention fills in the defaults: any key written beside it still wins.
"""

from __future__ import annotations

from typing import Any, Mapping

# HiFi-GAN's meldataset.mel_spectrogram (BigVGAN's is the same function): the clip reflected by
# (n_fft - hop) / 2 on each side, uncentred torch.stft with a periodic Hann window,
# sqrt(|X|^2 + 1e-9), librosa's Slaney filters, log(clamp(mel, 1e-5)).
_HIFIGAN = {"sample_rate_hz": 22050, "n_fft": 1024, "hop_length": 256, "win_length": 1024, "n_mels": 80,
            "fmin_hz": 0.0, "fmax_hz": 8000.0, "mel_scale": "slaney", "filter_norm": "slaney",
            "padding": "reflect_overlap", "window": "hann", "power": 1.0, "bin_power_offset": 1e-9,
            "bin_power_floor": 0.0, "log": "ln", "log_floor": 1e-5, "log_offset": 0.0}

CONVENTIONS: dict[str, dict[str, dict[str, Any]]] = {
    # hifi-gan meldataset.py mel_spectrogram, config_v1.json (LJSpeech, 22.05 kHz, 80 bands, fmax 8 kHz).
    "hifigan": {"features": _HIFIGAN},
    # bigvgan meldataset.py mel_spectrogram, bigvgan_v2_24khz_100band_256x (fmax: None, i.e. 12 kHz).
    "bigvgan_24khz_100band": {"features": {**_HIFIGAN, "sample_rate_hz": 24000, "n_mels": 100,
                                           "fmax_hz": 12000.0}},
    # vocos feature_extractors.py MelSpectrogramFeatures (F5-TTS's default mel): torchaudio's
    # MelSpectrogram(24000, n_fft 1024, hop 256, 100 mels, center, power 1: HTK filters without
    # normalisation) and safe_log, log(clamp(mel, 1e-5)).
    "vocos": {"features": {"sample_rate_hz": 24000, "n_fft": 1024, "hop_length": 256, "win_length": 1024,
                           "n_mels": 100, "fmin_hz": 0.0, "fmax_hz": 12000.0, "mel_scale": "htk",
                           "filter_norm": "none", "padding": "reflect", "window": "hann", "power": 1.0,
                           "bin_power_offset": 0.0, "bin_power_floor": 0.0, "log": "ln", "log_floor": 1e-5,
                           "log_offset": 0.0}},
    # matcha utils/audio.py mel_spectrogram: HiFi-GAN's, at 22.05 kHz (configs/data/ljspeech.yaml).
    "matcha": {"features": _HIFIGAN},
    # TTS utils/audio/processor.py AudioProcessor with BaseAudioConfig's defaults: librosa.stft
    # (centred, reflect), Slaney filters to mel_fmax None (sr / 2), 20 log10(max(1e-5, mel)),
    # signal_norm symmetric to [-4, 4] and clipped (ref_level_db 20, min_level_db -100); the
    # clips trimmed as load_wav trims them (trim_silence: 10 ms off each end, then
    # librosa.effects.trim at 45 dB over win_length frames).
    "coqui": {"features": {"sample_rate_hz": 22050, "n_fft": 1024, "hop_length": 256, "win_length": 1024,
                           "n_mels": 80, "fmin_hz": 0.0, "fmax_hz": 11025.0, "mel_scale": "slaney",
                           "filter_norm": "slaney", "padding": "reflect", "window": "hann", "power": 1.0,
                           "bin_power_offset": 0.0, "bin_power_floor": 0.0, "log": "db", "log_floor": 1e-5,
                           "log_offset": 0.0, "db_norm": "symmetric", "db_ref_level": 20.0,
                           "db_min_level": -100.0, "db_max_abs": 4.0},
              "transforms": {"trim_margin_s": 0.01, "trim_samples_db": 45.0}},
    # espnet2 layers/log_mel.py LogMelFbank with the LJSpeech TTS recipe's settings (fs 22050,
    # n_fft 1024, hop 256, fmin 80, fmax 7600): centred torch.stft (reflect), sqrt(max(|X|^2,
    # 1e-10)), librosa's Slaney filters, log10(max(mel, 1e-10)).
    "espnet": {"features": {"sample_rate_hz": 22050, "n_fft": 1024, "hop_length": 256, "win_length": 1024,
                            "n_mels": 80, "fmin_hz": 80.0, "fmax_hz": 7600.0, "mel_scale": "slaney",
                            "filter_norm": "slaney", "padding": "reflect", "window": "hann", "power": 1.0,
                            "bin_power_offset": 0.0, "bin_power_floor": 1e-10, "log": "log10",
                            "log_floor": 1e-10, "log_offset": 0.0}},
    # nemo collections/asr/parts/preprocessing/features.py FilterbankFeatures as NeMo's TTS
    # models configure it (FastPitch, HiFi-GAN: 22.05 kHz, 80 bands to 8 kHz, no dither,
    # preemph or normalize): centred torch.stft padded with zeros, a symmetric Hann window,
    # the magnitude, Slaney filters, log(mel + 1e-5) (log_zero_guard_type add).
    "nemo": {"features": {"sample_rate_hz": 22050, "n_fft": 1024, "hop_length": 256, "win_length": 1024,
                          "n_mels": 80, "fmin_hz": 0.0, "fmax_hz": 8000.0, "mel_scale": "slaney",
                          "filter_norm": "slaney", "padding": "constant", "window": "hann_symmetric",
                          "power": 1.0, "bin_power_offset": 0.0, "bin_power_floor": 0.0, "log": "ln",
                          "log_floor": 0.0, "log_offset": 1e-5}},
    # MyXTTS: tf.signal.stft(pad_end=True), the magnitude, tf.signal's HTK filters, log(mel + 1e-6),
    # each clip min-max scaled to [0, 1].
    "myxtts": {"features": {"sample_rate_hz": 22050, "n_fft": 1024, "hop_length": 256, "win_length": 1024,
                            "n_mels": 80, "fmin_hz": 0.0, "fmax_hz": 8000.0, "mel_scale": "tf",
                            "filter_norm": "none", "padding": "end", "window": "hann", "power": 1.0,
                            "bin_power_offset": 0.0, "bin_power_floor": 0.0, "log": "ln", "log_floor": 0.0,
                            "log_offset": 1e-6},
               "transforms": {"mel_norm": "clip_minmax"}},
}


def convention_settings(name: str) -> Mapping[str, Mapping[str, Any]]:
    """The sections and keys convention ``name`` sets; ValueError (one line) for an unknown name."""
    if name not in CONVENTIONS:
        raise ValueError(f"features.convention must be one of {', '.join(CONVENTIONS)}, got {name!r}")
    return CONVENTIONS[name]
