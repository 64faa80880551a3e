"""The XFS superblock (first 512 bytes of the filesystem), parsed. Pure code.

Only what the formula needs: UUID (fstab by UUID), block size, the data section's size (a
filesystem smaller than its device was not grown with it), the stripe geometry mkfs.xfs
stored (``sb_unit``/``sb_width``, in filesystem blocks) and whether mkfs.xfs finished
(``sb_inprogress``). Layout: xfs_format.h ``struct xfs_dsb``.
"""

import struct
import uuid as uuidlib

MAGIC = b"XFSB"
SUPERBLOCK_SIZE = 512


# A filesystem is "smaller than its device" from this much on: XFS grows its last allocation
# group or adds new ones of at least 16 MiB, so a smaller gap may be left by mkfs itself.
GROWABLE_BYTES = 64 << 20


# XFS_IOC_FSGEOMETRY_V1 (xfs_fs.h): the geometry of a mounted XFS, as the filesystem has it
# now. A mounted XFS writes its superblock through its own buffers, so sector 0 read through the
# block device lags it (after xfs_growfs, for as long as the page cache keeps the old sector).
GEOMETRY_SIZE = 112  # struct xfs_fsop_geom_v1


def geometry_ioctl(machine):
    """_IOR('X', 100, struct xfs_fsop_geom_v1) as the kernel of ``machine`` (platform.machine())
    spells it: powerpc, mips and sparc keep the direction in bits 29-31, the others in 30-31."""
    read = 0x40000000 if machine.startswith(("ppc", "powerpc", "mips", "sparc")) else 0x80000000
    return read | GEOMETRY_SIZE << 16 | ord("X") << 8 | 100


class XfsError(ValueError):
    """Not an XFS superblock, or an implausible one."""


def parse_superblock(raw):
    if len(raw) < 208:
        raise XfsError(f"superblock truncated: {len(raw)} bytes")
    if raw[:4] != MAGIC:
        raise XfsError("no XFS magic")
    blocksize, dblocks = struct.unpack_from(">IQ", raw, 4)
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
        "data_bytes": dblocks * blocksize,
        "sunit_bytes": sunit * blocksize,
        "swidth_bytes": swidth * blocksize,
    }


def parse_geometry(raw):
    """struct xfs_fsop_geom_v1 (host byte order) -> {"blocksize", "data_bytes"}."""
    if len(raw) < 40:
        raise XfsError(f"geometry truncated: {len(raw)} bytes")
    blocksize = struct.unpack_from("=I", raw, 0)[0]
    if blocksize < 512 or blocksize > 65536 or blocksize & (blocksize - 1):
        raise XfsError(f"implausible block size {blocksize}")
    return {"blocksize": blocksize, "data_bytes": struct.unpack_from("=Q", raw, 32)[0] * blocksize}
