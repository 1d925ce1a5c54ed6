"""A PyTorch DistributedDataParallel trainer on stoker's batches, one process per rank under torchrun.

    torchrun --nproc-per-node 2 docs/examples/ddp_trainer.py --data data/demo --epochs 5 \\
        --run-dir runs/ddp --checkpoint ckpts/ddp

Each rank makes its own ``stoker.Feed(framework="torch")`` with the same options. The feed
reads torchrun's RANK and WORLD_SIZE (as stoker's TensorFlow workers read TF_CONFIG): every
rank plans the same epochs and takes its share of every planned batch, so at each step every
rank trains a part of one global batch in the same bucket shape, all ranks take the same
number of steps per epoch, and each clip is trained once per epoch across them. Each rank
writes its run in ``RUN_DIR/worker-RANK``. The ranks of a host share one pool of producers
(``--producers`` of them, started by local rank 0, each producer serving every rank of the
host in plan order); ``--producers-per rank`` gives each rank ``--producers`` of its own.
The process group is nccl where each rank of the host has a GPU of its own, where the feed
stages each rank's batches onto ``cuda:LOCAL_RANK``; gloo on the CPU, and where ranks share
a GPU (fewer GPUs seen than LOCAL_WORLD_SIZE: rank R on ``cuda:R`` modulo the GPUs), since
nccl refuses two ranks on one device.

The step takes ``(tokens, mel, token_lengths, mel_lengths)`` tuples, as the user's trainer of
docs/examples/tuple_trainer.py does; its loss is the mean over the valid frames of the global
batch (each rank's sum over the frame count of all ranks), so the rows a rank's share left
empty (``row_mask`` 0) weigh nothing. After each epoch every rank runs one pass over the
held-out clips (the same clips on every rank) and rank 0 prints the validation loss.

Checkpoints are ``torch.distributed.checkpoint`` (DCP) directories ``CHECKPOINT/step-N``: the
model and the optimizer (replicated: written once), and ``feed.stateful()``: each rank's feed
state under a key of its own (``feed.worker-R``), which ``dcp.load`` restores into the rank's
feed before it starts. A checkpoint is written under a temporary name
and renamed by rank 0 once every rank's part is in, so a ``step-N`` directory is always whole.
Restart the same command after a crash, even a ``kill -9`` of one rank: every rank restores
the newest checkpoint, and its feed goes on from its own state there, so no clip is lost or
trained twice. torchrun's ``--max-restarts N`` restarts the job by itself; give it
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` and the c10d rendezvous (``--standalone`` on one
host), or the restarted ranks find the killed attempt's addresses in the store
(docs/design/training.md, "torchrun ranks")::

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc-per-node 2 --max-restarts 3 \
        docs/examples/ddp_trainer.py --data data/demo --run-dir runs/ddp --checkpoint ckpts/ddp
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parent))

import stoker  # noqa: E402
from torch_loop import TinyTTS  # noqa: E402

PARTIAL = ".partial-"  # a checkpoint being written: ignored on restore


def to_tuple(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The user's own batch format: what their trainer took before stoker."""
    return batch["tokens"], batch["mel"], batch["token_lengths"], batch["mel_lengths"]


def masked_l1_sum(model: torch.nn.Module, data: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """The absolute mel error summed over the valid frames of this rank's rows, and how many values that is."""
    tokens, mel, token_lengths, mel_lengths = data
    predicted = model(tokens, token_lengths, mel.shape[1], mel_lengths)
    mask = (torch.arange(mel.shape[1], device=mel.device)[None, :] < mel_lengths[:, None]).unsqueeze(-1)
    return ((predicted - mel).abs() * mask).sum(), mask.sum() * mel.shape[2]


def train_step(model: DistributedDataParallel, optimizer: torch.optim.Optimizer,
               data: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """One optimizer step of every rank on its share of the global batch; the global batch's loss."""
    model.train()
    optimizer.zero_grad(set_to_none=True)
    total, count = masked_l1_sum(model, data)
    counts = count.to(torch.float32)
    dist.all_reduce(counts)  # the valid values of the whole global batch
    # DDP averages the gradients over the ranks: times the world size, the update is the global mean's.
    loss = total / counts.clamp(min=1) * dist.get_world_size()
    loss.backward()
    optimizer.step()
    reported = total.detach() / counts.clamp(min=1)
    dist.all_reduce(reported)
    return reported


@torch.no_grad()
def validate(model: TinyTTS, feed: stoker.Feed) -> float | None:
    """The loss over one pass of the held-out clips (None: none held out)."""
    model.eval()
    total = count = 0.0
    for batch in feed.validation():
        errors, values = masked_l1_sum(model, to_tuple(batch))
        total, count = total + float(errors), count + float(values)
    return total / count if count else None


def checkpoint_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, feed: stoker.Feed) -> dict[str, Any]:
    """What a checkpoint holds, as DCP reads and writes it (the feed's Stateful keeps each rank's own)."""
    model_state, optimizer_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": optimizer_state, "feed": feed.stateful()}


def save_checkpoint(directory: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    feed: stoker.Feed) -> Path:
    """Every rank's part of checkpoint ``step-N`` written, then named by rank 0: its path."""
    step = feed.step
    final, partial = directory / f"step-{step:08d}", directory / f"{PARTIAL}{step:08d}"
    if dist.get_rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)
    dist.barrier()
    dcp.save(checkpoint_state(model, optimizer, feed), checkpoint_id=partial)
    dist.barrier()  # every rank's files are in (DCP wrote its metadata last)
    if dist.get_rank() == 0:
        os.replace(partial, final)
    dist.barrier()
    return final


def latest(directory: Path) -> Path | None:
    done = sorted(directory.glob("step-*")) if directory.is_dir() else []
    return done[-1] if done else None


def restore(directory: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, feed: stoker.Feed) -> None:
    """The newest checkpoint, if any, loaded into the model, the optimizer and the feed (not started yet)."""
    found = latest(directory)
    if found is None:
        return
    state = checkpoint_state(model, optimizer, feed)
    dcp.load(state, checkpoint_id=found)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    print(f"rank {dist.get_rank()}: restored {found.name}: the feed goes on from step {feed.state_dict()['step']}",
          flush=True)


def train(options: dict[str, Any], checkpoint_dir: Path, checkpoint_every: int,
          learning_rate: float = 3e-3) -> list[float]:
    """Train on this rank's feed; the global loss of every step."""
    torch.manual_seed(0)  # the same initial weights on every rank (DDP broadcasts rank 0's anyway)
    feed = stoker.Feed(framework="torch", **options)
    module = TinyTTS(feed.vocabulary.size, feed.n_mels)
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        torch.cuda.set_device(device)  # the GPU the feed stages this rank's batches onto
        model = DistributedDataParallel(module.to(device), device_ids=[device.index])
    else:
        model = DistributedDataParallel(module)
    optimizer = torch.optim.Adam(model.parameters(), lr=learning_rate)
    restore(checkpoint_dir, model, optimizer, feed)  # before the feed starts
    losses = []
    with feed:
        for batch in feed:
            loss = train_step(model, optimizer, to_tuple(batch))
            feed.step_done(loss=loss)
            losses.append(float(loss))
            if feed.step % feed.batches_per_epoch == 0:  # an epoch's end, at the same step on every rank
                val = validate(module, feed)
                if val is not None and dist.get_rank() == 0:
                    print(f"step {feed.step}: validation loss {val:.4f}", flush=True)
            if feed.step % checkpoint_every == 0:
                save_checkpoint(checkpoint_dir, model, optimizer, feed)
    return losses


def backend() -> str:
    """nccl where every rank of this host has a GPU of its own; gloo on the CPU or where ranks share one."""
    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= ranks_here else "gloo"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", help="dataset directory (default: stoker's demo data)")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--producers", type=int, default=1, help="producer processes of the host (or of each rank)")
    parser.add_argument("--producers-per", choices=("host", "rank"), default="host",
                        help="one pool for the ranks of a host, or producers of each rank's own")
    parser.add_argument("--batch-size", type=int, default=16, help="rows of each rank's share of a batch")
    parser.add_argument("--run-dir", required=True, help="the job's run directory (rank R writes worker-R in it)")
    parser.add_argument("--checkpoint", type=Path, required=True, metavar="DIR", help="DCP checkpoints, step-N")
    parser.add_argument("--checkpoint-every", type=int, default=4, metavar="STEPS")
    args = parser.parse_args(argv)
    options = {"data": args.data, "epochs": args.epochs, "producers": args.producers, "batch_size": args.batch_size,
               "run_dir": args.run_dir, "producers_per": args.producers_per}
    dist.init_process_group(backend())
    try:
        losses = train(options, args.checkpoint, args.checkpoint_every)
    finally:
        dist.destroy_process_group()
    if losses and int(os.environ.get("RANK", "0")) == 0:
        print(f"{len(losses)} steps: loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
