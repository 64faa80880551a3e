"""The XFS superblock (first 512 bytes of the filesystem), parsed. Pure code.

Only what the formula needs: UUID (fstab by UUID), block size, the stripe geometry mkfs.xfs
stored (``sb_unit``/``sb_width``, in filesystem blocks) and whether mkfs.xfs finished
(``sb_inprogress``). Layout: xfs_format.h ``struct xfs_dsb``.
"""

import struct
import uuid as uuidlib

MAGIC = b"XFSB"
SUPERBLOCK_SIZE = 512


class XfsError(ValueError):
    """Not an XFS superblock, or an implausible one."""


def parse_superblock(raw):
    if len(raw) < 208:
        raise XfsError(f"superblock truncated: {len(raw)} bytes")
    if raw[:4] != MAGIC:
        raise XfsError("no XFS magic")
    blocksize = struct.unpack_from(">I", raw, 4)[0]
    if blocksize < 512 or blocksize > 65536 or blocksize & (blocksize - 1):
        raise XfsError(f"implausible block size {blocksize}")
    sectsize = struct.unpack_from(">H", raw, 102)[0]
    sunit, swidth = struct.unpack_from(">II", raw, 184)
    label = raw[108:120].split(b"\0", 1)[0].decode("latin-1")
    return {
        # mkfs.xfs sets sb_inprogress first and clears it last: set means an interrupted mkfs
        "inprogress": raw[126] != 0,
        "uuid": str(uuidlib.UUID(bytes=bytes(raw[32:48]))),
        "label": label,
        "blocksize": blocksize,
        "sectsize": sectsize,
        "sunit_bytes": sunit * blocksize,
        "swidth_bytes": swidth * blocksize,
    }
