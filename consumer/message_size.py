"""The wire-size check: a plan whose largest batch would not cross the wire is refused
before training.

The coordinator's socket refuses frames over ``pipeline.max_message_mb`` by closing the
connection, so a bucket whose BATCH (every field of the batch schema at its dimensions, and
the header's room: shared/wire.header_bytes) is larger would drop every producer that sends
it. docs/design/protocol.md, "Protocol", tells where the check runs.
"""

from __future__ import annotations

from typing import Iterable, Sequence

from ..shared.batch import batch_dims
from ..shared.config import Config, batch_schema
from ..shared.errors import UserError
from ..shared.wire import header_bytes


class MessageTooLarge(UserError):
    """A planned batch would not cross the wire: above ``pipeline.max_message_mb`` (one line)."""


def message_bytes(cfg: Config, rows: int, shape: Sequence[int]) -> dict[str, int]:
    """Each field's bytes in a BATCH of ``rows`` rows of bucket ``shape`` = (L, T): the run's
    batch schema (its optional and declared fields too) at that bucket's dimensions."""
    f = cfg.features
    return batch_schema(cfg).nbytes(batch_dims(rows, shape, f.n_mels, f.hop_length, cfg.batching.ref_frames))


def check_message_size(cfg: Config, shapes: Iterable[tuple[int, int, int]]) -> None:
    """Refuse a plan whose largest batch (``shapes``: (B, L, T) of every planned batch,
    training and validation) is over ``pipeline.max_message_mb`` with its header: the
    coordinator's socket would drop every producer that sends it (MessageTooLarge, one line
    naming the bucket, its size and the settings that fix it)."""
    limit = cfg.pipeline.max_message_bytes
    sized = [(sum(message_bytes(cfg, b, (l, t)).values()) + header_bytes(b, cfg.features.n_mels), (b, l, t))
             for b, l, t in shapes]
    if not sized:
        return
    size, (rows, tokens, frames) = max(sized)
    if size <= limit:
        return
    fields = message_bytes(cfg, rows, (tokens, frames))
    heaviest = ", ".join(f"{name} {n / 2**20:.1f}" for name, n in sorted(fields.items(), key=lambda kv: -kv[1])
                         if n >= size / 10)  # the fields that make it large
    seconds = frames * cfg.features.hop_length / cfg.features.sample_rate_hz
    budget = cfg.batching.max_frames
    rows_fix = (f"lower the frame budget batching.max_frames (now {budget})" if budget else
                f"fewer rows: a frame budget batching.max_frames, or a lower batching.batch_size (now "
                f"{cfg.batching.batch_size})")
    raise MessageTooLarge(
        f"the planned batch of bucket (B={rows}, L={tokens}, T={frames}: clips up to {seconds:.0f} s) is "
        f"{size / 2**20:.1f} MB on the wire ({heaviest} MB), over pipeline.max_message_mb="
        f"{cfg.pipeline.max_message_mb}: raise pipeline.max_message_mb, leave long clips out with a lower "
        f"data.max_audio_s (now {cfg.data.max_audio_s:g}), or {rows_fix}")

