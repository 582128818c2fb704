"""Hugging Face checkpoint folders: config.json plus safetensors, sharded or not.

Reads tensors by name so each role can load only what it owns, and counts what it
read (the tests check that attention never touches expert weights and the FFN never
touches embeddings). The fingerprint lets two peers prove they hold the same weights.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Iterable

import torch
from safetensors import safe_open

SUPPORTED_ARCHITECTURES = ("deepseek_v2", "deepseek_v3", "kimi_k2", "deepseek_v32", "qwen3_moe", "glm4_moe")
_FINGERPRINT_SAMPLE_BYTES = 1 << 16


class CheckpointError(ValueError):
    """A checkpoint folder that cannot be served; the message says what is wrong."""


def _check_readable(file: Path) -> None:
    """CheckpointError naming the real cause when `file` cannot be opened (e.g. permission
    denied: a 0600 file of another user, as a non-root pod sees a root-written host path)."""
    try:
        with open(file, "rb"):
            pass
    except PermissionError:
        try:
            st = file.stat()
            owner = f"mode {st.st_mode & 0o777:04o}, owner uid {st.st_uid}"
        except OSError:
            owner = "its folder is not readable"
        raise CheckpointError(
            f"checkpoint {file}: permission denied ({owner}; this process runs as uid {os.getuid()}); "
            "make the checkpoint readable by it, e.g. chmod -R a+rX on the model folder"
        ) from None
    except OSError as err:
        raise CheckpointError(f"checkpoint {file}: cannot open it ({err.strerror})") from None


class Checkpoint:
    """One checkpoint folder: its config and a name → file index of its tensors."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            is_dir = self.path.is_dir()
        except PermissionError:
            raise CheckpointError(f"checkpoint {self.path}: permission denied on a folder above it (this "
                                  f"process runs as uid {os.getuid()})") from None
        if not is_dir:
            raise CheckpointError(f"checkpoint {self.path}: no such folder")
        config_file = self.path / "config.json"
        if not config_file.is_file():
            raise CheckpointError(f"checkpoint {self.path}: no config.json (expected a Hugging Face model folder)")
        _check_readable(config_file)
        try:
            self.config: dict = json.loads(config_file.read_text())
        except json.JSONDecodeError as err:
            raise CheckpointError(f"checkpoint {self.path}: config.json is not valid JSON ({err})") from None
        self.arch = self.config.get("model_type", "")
        if self.arch not in SUPPORTED_ARCHITECTURES:
            raise CheckpointError(
                f"checkpoint {self.path}: unsupported architecture model_type={self.arch!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        self.files = sorted(self.path.glob("*.safetensors"))
        if not self.files:
            raise CheckpointError(f"checkpoint {self.path}: no *.safetensors weight files")
        self._index = self._build_index()
        self._dtypes: dict[str, str] | None = None
        self.loaded_keys: list[str] = []

    def _build_index(self) -> dict[str, Path]:
        index: dict[str, Path] = {}
        for file in self.files:
            _check_readable(file)  # safetensors words a permission error as "No such file"
            try:
                with safe_open(str(file), framework="pt") as handle:
                    for key in handle.keys():
                        index[key] = file
            except Exception as err:  # safetensors raises several types for a bad header
                raise CheckpointError(f"checkpoint {file}: unreadable safetensors file ({err})") from None
        return index

    def dtypes(self) -> dict[str, str]:
        """Tensor name → its safetensors dtype ("BF16", "F8_E4M3", ...), from the files' headers alone."""
        if self._dtypes is None:
            self._dtypes = {}
            for file in self.files:
                with file.open("rb") as handle:
                    header = json.loads(handle.read(int.from_bytes(handle.read(8), "little")))
                self._dtypes.update({k: v["dtype"] for k, v in header.items() if k != "__metadata__"})
        return self._dtypes

    def __contains__(self, key: str) -> bool:
        return key in self._index

    def keys(self) -> list[str]:
        return sorted(self._index)

    def read(self, keys: Iterable[str]) -> dict[str, torch.Tensor]:
        """Read exactly `keys` from disk, grouped by file; records them in `loaded_keys`."""
        by_file: dict[Path, list[str]] = {}
        for key in keys:
            if key not in self._index:
                raise CheckpointError(f"checkpoint {self.path}: tensor {key!r} is missing")
            by_file.setdefault(self._index[key], []).append(key)
        tensors: dict[str, torch.Tensor] = {}
        for file, file_keys in by_file.items():
            with safe_open(str(file), framework="pt") as handle:
                for key in file_keys:
                    tensors[key] = handle.get_tensor(key)
        self.loaded_keys.extend(tensors)
        return tensors

    def read_part(self, key: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """Rows (`dim` 0) or columns (`dim` 1) [start, stop) of tensor `key`, reading only those bytes."""
        if key not in self._index:
            raise CheckpointError(f"checkpoint {self.path}: tensor {key!r} is missing")
        with safe_open(str(self._index[key]), framework="pt") as handle:
            sliced = handle.get_slice(key)
            tensor = sliced[start:stop] if dim == 0 else sliced[:, start:stop]
        self.loaded_keys.append(key)
        return tensor

    def fingerprint(self) -> str:
        """Cheap identity of the weights: config, tensor tables and sampled bytes of each file.

        Hashing every byte of a 30 GB checkpoint at start-up is too slow; the tensor
        table plus the first and last 64 KiB of tensor data of each file differ between
        any two real checkpoints (and between two random tiny ones with other seeds).
        """
        digest = hashlib.sha256(json.dumps(self.config, sort_keys=True).encode())
        for file in self.files:
            size = file.stat().st_size
            digest.update(f"{file.name}:{size}".encode())
            with file.open("rb") as handle:
                header_len = int.from_bytes(handle.read(8), "little")
                digest.update(handle.read(min(header_len, size)))  # tensor table: names, shapes, dtypes
                for offset in (8 + header_len, max(8 + header_len, size - _FINGERPRINT_SAMPLE_BYTES)):
                    handle.seek(offset)
                    digest.update(handle.read(_FINGERPRINT_SAMPLE_BYTES))
        return digest.hexdigest()[:16]
