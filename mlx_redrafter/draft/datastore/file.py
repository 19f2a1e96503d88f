"""The datastore's file: versioned, keyed by the model, checksummed, written atomically.

Layout (little-endian)::

    header   magic b"MLXRDDS\\0", u32 format version, u32 model key bytes,
             u64 sequences, u64 tokens
    key      the model key (utf-8): token ids mean nothing for another model
    lengths  int32 [sequences]
    tokens   int32 [tokens]
    crc32    u32 of everything above

Only the sequences are kept: the suffix index is rebuilt on first use (tens
of milliseconds for 200k tokens), which keeps the file at 4 bytes a token.
"""

from __future__ import annotations

import struct
import zlib
from pathlib import Path
from typing import List

import numpy as np

from ...errors import RedrafterError
from ...files import atomic_file

MAGIC = b"MLXRDDS\0"
VERSION = 1
HEADER = struct.Struct("<8sIIQQ")
CRC = struct.Struct("<I")
FIX = "Run `mlx-redrafter datastore clear` (or delete the file) to start a new store there."


def write_store(path, model_key: str, sequences: List[np.ndarray]) -> None:
    """Write ``sequences`` (int32 arrays) to ``path`` atomically."""
    path = Path(path)
    key = model_key.encode()
    lengths = np.array([len(s) for s in sequences], "<i4")
    tokens = np.concatenate(sequences).astype("<i4") if sequences else np.zeros(0, "<i4")
    body = HEADER.pack(MAGIC, VERSION, len(key), len(lengths), len(tokens)) + key + lengths.tobytes() + tokens.tobytes()
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(path) as tmp:
        tmp.write_bytes(body + CRC.pack(zlib.crc32(body)))


def _refuse(path, problem: str) -> RedrafterError:
    return RedrafterError(f"The datastore {path} {problem}", FIX)


def read_store(path, model_key: str) -> List[np.ndarray]:
    """The sequences saved in ``path``; :class:`RedrafterError` (naming the
    file and the fix) if it is no datastore, is corrupt, has another format
    version or was built for another model than ``model_key``."""
    data = Path(path).read_bytes()
    if len(data) < HEADER.size + CRC.size or not data.startswith(MAGIC):
        raise _refuse(path, "is not a mlx-redrafter datastore file (no datastore header).")
    _, version, key_len, n_seqs, n_tokens = HEADER.unpack_from(data)
    if version != VERSION:
        raise _refuse(path, f"has format version {version}; this mlx-redrafter reads version {VERSION}.")
    size = HEADER.size + key_len + 4 * (n_seqs + n_tokens) + CRC.size
    if len(data) != size or CRC.unpack_from(data, size - CRC.size)[0] != zlib.crc32(data[: size - CRC.size]):
        raise _refuse(path, "is corrupt (its size or checksum does not match its contents).")
    key = data[HEADER.size : HEADER.size + key_len].decode(errors="replace")
    if key != model_key:
        raise _refuse(path, f"was built for the model {key!r}, not {model_key!r}: its token ids mean nothing here.")
    start = HEADER.size + key_len
    lengths = np.frombuffer(data, "<i4", n_seqs, start)
    tokens = np.frombuffer(data, "<i4", n_tokens, start + 4 * n_seqs).astype(np.int32)
    if lengths.sum(dtype=np.int64) != n_tokens or (lengths < 0).any() or (tokens < 0).any():
        raise _refuse(path, "is corrupt (its sequence lengths or token ids are invalid).")
    return np.split(tokens, np.cumsum(lengths)[:-1]) if n_seqs else []
