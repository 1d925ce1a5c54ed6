"""A child for tests/stoker/test_devices_gpu.py, started as the launcher starts a producer or
the trainer (``python -m tests.stoker.cuda_probe --parent-pid P --status-fd F``): it tells on its
status pipe the CUDA devices it sees, through PyTorch or CuPy (``--library``), with their PCI
location, and the CUDA_VISIBLE_DEVICES it was given."""

from __future__ import annotations

import argparse
import os
from typing import Any

from stoker.shared.proc import StatusWriter


def torch_devices() -> list[dict[str, Any]]:
    import torch

    devices = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        pci = [getattr(props, f"pci_{part}_id", None) for part in ("domain", "bus", "device")]
        uuid = getattr(props, "uuid", None)  # both there in recent PyTorch; either names the card
        devices.append({"name": props.name, "pci": None if None in pci else pci,
                        "uuid": None if uuid is None else str(uuid)})
    return devices


def cupy_devices() -> list[dict[str, Any]]:
    from cupy.cuda import runtime

    try:
        count = runtime.getDeviceCount()
    except runtime.CUDARuntimeError:  # cudaErrorNoDevice: CUDA_VISIBLE_DEVICES hides every GPU
        count = 0
    devices = []
    for index in range(count):
        props = runtime.getDeviceProperties(index)
        name = props["name"]
        devices.append({"name": name.decode() if isinstance(name, bytes) else name,
                        "pci": [props["pciDomainID"], props["pciBusID"], props["pciDeviceID"]], "uuid": None})
    return devices


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.stoker.cuda_probe")
    parser.add_argument("--library", choices=("torch", "cupy"), required=True)
    parser.add_argument("--parent-pid", type=int, default=None)
    parser.add_argument("--status-fd", type=int, default=None)
    args = parser.parse_args()
    devices = torch_devices() if args.library == "torch" else cupy_devices()
    StatusWriter(args.status_fd).send("devices", visible=os.environ.get("CUDA_VISIBLE_DEVICES"), devices=devices)


if __name__ == "__main__":
    main()
