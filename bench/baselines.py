"""What a user can do instead of ckptdoctor, as functions ``bench/probe.py call baselines:NAME ROOT`` runs."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator


def _files(root: str, suffixes: tuple[str, ...]) -> Iterator[str]:
    for d, _, names in sorted(os.walk(root)):
        for n in sorted(names):
            # training_args.bin pickles a TrainingArguments: weights_only refuses it, and no resume code loads it.
            if n.endswith(suffixes) and n != "training_args.bin":
                yield os.path.join(d, n)


_TORCH = (".pt", ".pth", ".bin")


def safe_open_walk(root: str) -> None:
    """Every safetensors header through ``safe_open`` (keys, shapes, dtypes, metadata), plus every JSON file."""
    _header_walk(root, "pt")
    json_load(root)


def safe_open_walk_np(root: str) -> None:
    """``safe_open_walk`` with ``framework="np"``: the same header walk without importing torch (numpy instead)."""
    _header_walk(root, "np")
    json_load(root)


def _header_walk(root: str, framework: str) -> None:
    from safetensors import safe_open

    for path in _files(root, (".safetensors",)):
        with safe_open(path, framework) as f:
            f.metadata()
            for k in f.keys():  # noqa: SIM118  (safe_open is not iterable)
                s = f.get_slice(k)
                s.get_shape(), s.get_dtype()


def json_load(root: str) -> None:
    """``json.load`` of every JSON file: the part of the walks above that is not safetensors."""
    for path in _files(root, (".json",)):
        with open(path) as f:
            json.load(f)


def torch_mmap(root: str) -> None:
    """``torch.load(mmap=True, weights_only=True)`` of every torch file (rng_state needs numpy's globals allowed)."""
    import numpy as np
    import torch

    safe = [np._core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]
    with torch.serialization.safe_globals(safe):
        for path in _files(root, _TORCH):
            torch.load(path, mmap=True, weights_only=True)


def metadata_walk(root: str) -> None:
    """The cheapest full look a user can take with the libraries: safe_open walk + torch.load(mmap=True)."""
    safe_open_walk(root)
    torch_mmap(root)


def naive(root: str) -> None:
    """What resume itself does: ``load_file`` of every safetensors file and ``torch.load`` of every torch file."""
    import numpy as np
    import torch
    from safetensors.torch import load_file

    for path in _files(root, (".safetensors",)):
        load_file(path)
    safe = [np._core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]
    with torch.serialization.safe_globals(safe):
        for path in _files(root, _TORCH):
            torch.load(path, weights_only=True)
    for path in _files(root, (".json",)):
        with open(path) as f:
            json.load(f)


def plain_read(root: str) -> None:
    """A plain sequential read of every file in 1 MiB chunks: the floor for anything that reads all bytes."""
    buf = bytearray(1 << 20)
    view = memoryview(buf)
    for path in _files(root, ("",)):
        with open(path, "rb", buffering=0) as f:
            while f.readinto(view):
                pass


def imports_only() -> None:
    """Start-up reference: the interpreter plus ``import ckptdoctor.cli``."""
    import ckptdoctor.cli  # noqa: F401
