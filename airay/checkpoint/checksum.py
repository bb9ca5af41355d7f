"""The CRC-32 of every checkpoint byte written, copied, uploaded and loaded.

zlib's CRC-32 (the polynomial of zip files and of `zlib.crc32`: manifests written before stay
valid), computed by zlib-ng's SIMD implementation, several times faster than zlib's. A save
computes it twice as it writes (the file's and each chunk's), which with zlib's was a large
share of the CPU time of writing a file to node memory."""

from zlib_ng.zlib_ng import crc32

__all__ = ["crc32"]
