"""The CRC-32s of every checkpoint byte written, copied, uploaded and loaded.

zlib's CRC-32 (the polynomial of zip files and of `zlib.crc32`: manifests written before stay
valid), computed by zlib-ng's SIMD implementation, several times faster than zlib's. A save
computes it twice as it writes (the file's and each chunk's), which with zlib's was a large
share of the CPU time of writing a file to node memory.

A file's chunk CRCs are kept beside it, in its CRC sidecar (`crc_sidecar(name)`: little-endian
uint32s, one a chunk), which the manifest lists as a file of its own (size and CRC-32): fine
chunks for a resharded load's reads (ZeRO-3 needs one piece of every parameter from each old
partition), while the manifest stays O(files) at thousands of ranks."""

import struct

from zlib_ng.zlib_ng import crc32

__all__ = ["crc32", "crc_sidecar", "is_sidecar", "pack_crcs", "unpack_crcs"]

SIDECAR = ".crc32"


def crc_sidecar(name: str) -> str:
    """The name of the file holding `name`'s chunk CRCs."""
    return name + SIDECAR


def is_sidecar(name: str) -> bool:
    return name.endswith(SIDECAR)


def pack_crcs(crcs: list[int]) -> bytes:
    return struct.pack(f"<{len(crcs)}I", *crcs)


def unpack_crcs(data: bytes) -> list[int]:
    if len(data) % 4:
        raise ValueError(f"a CRC sidecar of {len(data)} bytes: not whole uint32s")
    return list(struct.unpack(f"<{len(data) // 4}I", data))
