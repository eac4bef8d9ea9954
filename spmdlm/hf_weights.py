"""The tensors of a transformers checkpoint directory, in every layout transformers writes: `model.safetensors`,
sharded safetensors with their index, `pytorch_model.bin` and sharded `.bin` files with theirs. Read one tensor at a
time, without running pickled code; names and shapes are what spmdlm.export matches against a family's table.
"""

from __future__ import annotations

import contextlib
import json
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import SafetensorError, safe_open

from spmdlm import storage
from spmdlm.errors import ExportError

WEIGHT_LAYOUTS = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)  # transformers' order of preference


class CheckpointTensors:
    """The tensors of a transformers checkpoint directory in any layout transformers writes (WEIGHT_LAYOUTS: one
    file, or shards listed by an index's weight_map), read one tensor at a time. PyTorch `.bin` files are read with
    `torch.load(weights_only=True)`, which runs no pickled code, memory-mapped. A bucket's files are copied to local
    disk first, each when first needed."""

    def __init__(self, path: Path):
        self.path = path
        layout = next((name for name in WEIGHT_LAYOUTS if (path / name).is_file()), None)
        if layout is None:
            other = sorted(p.name for pattern in ("*.h5", "*.msgpack", "*.ckpt*") for p in path.glob(pattern))
            hint = (
                (
                    f" (found {', '.join(other)}: load it in transformers and save_pretrained it, which writes "
                    "model.safetensors)"
                )
                if other
                else ""
            )
            raise ExportError(f"{path}: no weights: expected {', '.join(WEIGHT_LAYOUTS)}{hint}")
        self._open: dict[str, Any] = {}
        self.file_of = self._weight_map(layout)

    def _weight_map(self, layout: str) -> dict[str, str]:
        if not layout.endswith(".index.json"):
            return {name: layout for name in self._file(layout).keys()}
        index = self.path / layout
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError(f"a {type(weight_map).__name__}, not a mapping")
        except (ValueError, KeyError, TypeError) as e:
            raise ExportError(
                f"{index} is not a checkpoint index (no weight_map: {e}); re-save the checkpoint with save_pretrained"
            ) from None
        outside = sorted({repr(f) for f in weight_map.values() if not storage.inside(f)})
        if outside:
            raise ExportError(
                f"{index} lists a shard outside its checkpoint folder ({', '.join(outside[:3])}): a file a checkpoint "
                "names must be inside that folder; put the shards beside the index and name them by file name"
            )
        absent = sorted({f for f in weight_map.values() if not (self.path / f).is_file()})
        if absent:
            raise ExportError(f"{index} lists shards that are not there: {', '.join(absent[:3])}; download them too")
        return dict(weight_map)

    def _file(self, name: str):
        if name not in self._open:
            local = str(storage.local_copy(self.path / name))
            with self._readable(name):
                self._open[name] = (
                    _torch_load(local) if name.endswith(".bin") else safe_open(local, framework="numpy").__enter__()
                )
        return self._open[name]

    @contextlib.contextmanager
    def _readable(self, name: str):
        """A truncated or damaged safetensors file is one line, when it is opened or when a tensor is read."""
        try:
            yield
        except SafetensorError as e:
            raise ExportError(
                f"{self.path / name} is truncated or damaged ({str(e).splitlines()[0]}); export or download it again"
            ) from None

    def names(self) -> set[str]:
        return set(self.file_of)

    def shape(self, name: str) -> tuple[int, ...]:
        file = self._file(self.file_of[name])
        return tuple(file[name].shape) if isinstance(file, dict) else tuple(file.get_slice(name).get_shape())

    def get(self, name: str) -> np.ndarray:
        """A tensor as float32 (the tensors of a .bin file are torch's, of any float dtype)."""
        file = self._file(self.file_of[name])
        if isinstance(file, dict):
            return file[name].float().numpy()
        with self._readable(self.file_of[name]):
            return file.get_tensor(name).astype(np.float32)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._open.values():
            if not isinstance(handle, dict):
                handle.__exit__(None, None, None)
        self._open.clear()


def _torch_load(file: str) -> dict:
    """A PyTorch state dict without running pickled code; one line where torch is missing or the file is not one."""
    try:
        import torch
    except ImportError:
        raise ExportError(
            f"{file} is a PyTorch checkpoint, which needs torch to read (pip install 'spmdlm[torch]'), "
            "or convert it once to model.safetensors: transformers' from_pretrained, then "
            "save_pretrained"
        ) from None
    try:
        # mmap only for the zip format (torch >= 1.6); older files are read whole
        return torch.load(file, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(file))
    except Exception as e:  # noqa: BLE001 - pickle's UnpicklingError, zipfile's and torch's RuntimeError
        first = str(e).strip().partition("\n")[0]
        raise ExportError(f"cannot read {file} as plain tensors (torch.load weights_only=True): {first}") from None
