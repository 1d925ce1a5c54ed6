"""The wire-size check: a plan whose largest batch would not cross the wire is refused in one line."""

from __future__ import annotations

import pytest

from stoker.consumer.message_size import MessageTooLarge, check_message_size, message_bytes
from stoker.shared.config import from_dict
from stoker.shared.wire import header_bytes


def _message_cfg(**sections):
    return from_dict({"features": {"n_mels": 80, "hop_length": 256}, **sections})


def test_message_bytes_is_every_field_at_the_bucket_dims() -> None:
    # B=4, L=88, T=310080 (a one-hour clip at hop 256): the largest bucket, ~397 MB of mel.
    plain = message_bytes(_message_cfg(), 4, (88, 310080))
    assert plain == {"tokens": 4 * 88 * 4, "token_lengths": 16, "mel": 4 * 310080 * 80 * 4, "mel_lengths": 16}
    assert 396 < plain["mel"] / 1e6 < 398
    with_audio = message_bytes(_message_cfg(batching={"fields": "audio,ref_mel", "ref_frames": 100}), 2, (8, 10))
    assert with_audio["audio"] == 2 * 10 * 256 * 4  # S = T x hop_length
    assert with_audio["ref_mel"] == 2 * 100 * 80 * 4  # R = batching.ref_frames
    assert with_audio["audio_lengths"] == with_audio["ref_mel_lengths"] == 2 * 4


def test_a_plan_above_max_message_mb_is_refused_in_one_line() -> None:
    cfg = _message_cfg(pipeline={"max_message_mb": 256})
    with pytest.raises(MessageTooLarge) as refused:
        check_message_size(cfg, [(16, 40, 800), (4, 88, 310080), (1, 88, 310080)])
    line = str(refused.value)
    assert "\n" not in line
    for named in ("(B=4, L=88, T=310080", "pipeline.max_message_mb=256", "data.max_audio_s", "batching.max_frames",
                  "batching.batch_size"):
        assert named in line
    check_message_size(cfg, [(16, 40, 800), (1, 88, 310080)])  # 99 MB: it fits
    # The limit is exact: the arrays and the header's room (shared/wire.header_bytes), against
    # max_message_mb MiB. Short clips (T=10): a row's header room weighs, and counts.
    small = _message_cfg(pipeline={"max_message_mb": 1})

    def arrays(rows: int) -> int:
        return sum(message_bytes(small, rows, (8, 10)).values())

    rows = max(r for r in range(1, 1000) if arrays(r) + header_bytes(r, 80) <= 1 << 20)
    check_message_size(small, [(rows, 8, 10)])
    assert arrays(rows + 1) <= 1 << 20  # the arrays alone would fit: the header's room refuses them
    with pytest.raises(MessageTooLarge):
        check_message_size(small, [(rows + 1, 8, 10)])
