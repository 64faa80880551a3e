"""The formula's own file I/O: files written whole or not at all (crypttab, fstab, key files,
header backups), and in-memory copies of a device's first bytes.

A file is replaced by a new one written beside it (same directory, so the same file system),
synced, given the old file's mode and owner, and renamed over it; the directory is synced after
the rename. A kill at any moment leaves the old file or the new one: a host whose crypttab was
truncated by a killed write does not boot.
"""

import contextlib
import os
import stat

TEMPORARY = ".{name}.hana-storage.new"  # beside the file; a killed write's is removed by the next


def replace_file(path, data, mode=0o644, uid=0, gid=0):
    """Replace ``path`` with ``data`` (bytes) atomically. An existing file keeps its mode and
    owner; a new one gets ``mode``, ``uid`` and ``gid``. A symlink at ``path`` is refused (OSError):
    whoever may replace a link chooses the file written."""
    directory, name = os.path.split(os.path.abspath(path))
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        info = None
    if info is not None and not stat.S_ISREG(info.st_mode):
        raise OSError(f"{path} is not a regular file: not replacing it")
    if info is not None:
        mode, uid, gid = stat.S_IMODE(info.st_mode), info.st_uid, info.st_gid
    folder = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    temporary = TEMPORARY.format(name=name)
    try:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary, dir_fd=folder)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        descriptor = os.open(temporary, flags, 0o600, dir_fd=folder)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(descriptor, view) :]
            os.fchown(descriptor, uid, gid)
            os.fchmod(descriptor, mode)
            os.fsync(descriptor)
        finally:
            os.close(descriptor)
        os.rename(temporary, name, src_dir_fd=folder, dst_dir_fd=folder)
        os.fsync(folder)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary, dir_fd=folder)
        raise
    finally:
        os.close(folder)


@contextlib.contextmanager
def memory_copy(path, size):
    """A copy of the first ``size`` bytes of ``path`` in memory (memfd: never on a disk, never
    swapped... unless memory is), as a path other processes of this user can open:
    ``/proc/<pid>/fd/<n>``. What a LUKS header is handed to cryptsetup as, because cryptsetup
    repairs a damaged header copy as it loads one: the device itself is only read."""
    copy = os.memfd_create("hana-storage-luks-header", os.MFD_CLOEXEC)
    try:
        source = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            done = 0
            while done < size:
                chunk = os.pread(source, min(size - done, 1 << 22), done)
                if not chunk:
                    break
                done += os.write(copy, chunk)
        finally:
            os.close(source)
        yield f"/proc/{os.getpid()}/fd/{copy}"
    finally:
        os.close(copy)
