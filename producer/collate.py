"""Collation: pad a planned batch's examples into fixed bucket-shaped arrays.

Dimension legend:
    B  batch size (fixed; rows past the real examples are empty, length 0)
    L  token length of the bucket (padded)
    T  mel frames of the bucket (padded)
    F  mel channels (features.n_mels)

Arrays of a batch, as they travel and as the trainer receives them:

    tokens         int32    [B, L]     token ids of the run's vocabulary (shared/text.py); padding PAD_ID = 0
    token_lengths  int32    [B]        valid tokens per row (EOS included); 0 for empty rows
    mel            float32  [B, T, F]  log-mel (producer/features.py); padding log(log_floor)
    mel_lengths    int32    [B]        valid frames per row; 0 for empty rows
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from shared.text import PAD_ID

BATCH_ARRAYS = ("tokens", "token_lengths", "mel", "mel_lengths")


def collate(tokens: Sequence[np.ndarray], mels: Sequence[np.ndarray], batch_size: int,
            max_tokens: int, max_frames: int, n_mels: int, mel_pad_value: float) -> dict[str, np.ndarray]:
    """Pad examples into the bucket shape [B, L] / [B, T, F]; raise if one does not fit."""
    if len(tokens) != len(mels):
        raise ValueError("tokens and mels differ in count")
    if len(tokens) > batch_size:
        raise ValueError(f"{len(tokens)} examples for a batch of {batch_size}")
    out_tokens = np.full((batch_size, max_tokens), PAD_ID, dtype=np.int32)
    out_mel = np.full((batch_size, max_frames, n_mels), mel_pad_value, dtype=np.float32)
    token_lengths = np.zeros(batch_size, dtype=np.int32)
    mel_lengths = np.zeros(batch_size, dtype=np.int32)
    for row, (tok, mel) in enumerate(zip(tokens, mels)):
        if len(tok) > max_tokens or mel.shape[0] > max_frames or mel.shape[1] != n_mels:
            raise ValueError(f"example of {len(tok)} tokens, {mel.shape} mel exceeds bucket "
                             f"({max_tokens}, {max_frames}, {n_mels})")
        out_tokens[row, :len(tok)] = tok
        out_mel[row, :mel.shape[0]] = mel
        token_lengths[row] = len(tok)
        mel_lengths[row] = mel.shape[0]
    return {"tokens": out_tokens, "token_lengths": token_lengths, "mel": out_mel, "mel_lengths": mel_lengths}
