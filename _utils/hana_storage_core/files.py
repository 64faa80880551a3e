"""The formula's own file I/O: files written whole or not at all (crypttab, fstab, key files,
header backups), and in-memory copies of a device's first bytes.

A file is replaced by a new one written beside it (same directory, so the same file system),
synced, given the old file's mode and owner, and renamed over it; the directory is synced after
the rename. A kill at any moment leaves the old file or the new one: a host whose crypttab was
truncated by a killed write does not boot.
"""

import contextlib
import fcntl
import os
import stat
import time

TEMPORARY = ".{name}.hana-storage.new"  # beside the file; a killed write's is removed by the next


def replace_file(path, data, mode=None, mtime=None, dir_fd=None):
    """Replace ``path`` with ``data`` (bytes) whole: a temporary beside it, written, synced,
    renamed over it, the directory synced.

    mode
        The new file's permission bits (0400 for a key), owned by this process's user; None keeps
        an existing file's mode and owner (a new one gets 0644).
    mtime
        The new file's modification time (the triage outbox keeps an event's due time there).
    dir_fd
        A descriptor of the directory: ``path`` is then a name in it (the beacon holds its
        memory's directory open, so a link swapped in above it changes nothing).

    A symlink at ``path`` is replaced by the file, never written through (whoever may replace a
    link would choose the file written); a directory or a device there is refused (OSError).
    """
    own = dir_fd is None
    if own:
        directory, name = os.path.split(os.path.abspath(path))
        folder = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    else:
        folder, name = dir_fd, path
    temporary = TEMPORARY.format(name=name)
    try:
        try:
            info = os.lstat(name, dir_fd=folder)
        except FileNotFoundError:
            info = None
        if info is not None and not (stat.S_ISREG(info.st_mode) or stat.S_ISLNK(info.st_mode)):
            raise OSError(f"{path} is not a regular file: not replacing it")
        if info is not None and stat.S_ISLNK(info.st_mode):
            info = None  # the link itself is replaced: what it points to is never written
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary, dir_fd=folder)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        descriptor = os.open(temporary, flags, 0o600, dir_fd=folder)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(descriptor, view) :]
            if mode is not None:
                os.fchmod(descriptor, mode)
            elif info is not None:
                os.fchown(descriptor, info.st_uid, info.st_gid)
                os.fchmod(descriptor, stat.S_IMODE(info.st_mode))
            else:
                os.fchmod(descriptor, 0o644)
            if mtime is not None:
                os.utime(descriptor, (mtime, mtime))
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
        if own:
            os.close(folder)


def create_file(path, data, mode):
    """Write ``data`` (bytes) to ``path`` as a new file, whole or not at all: a temporary beside
    it, written and synced, then linked to ``path`` - which fails (FileExistsError) when anything
    is there, a symlink included. Never replaces a file: what a report is written over could be
    anything, signed-off evidence included."""
    directory, name = os.path.split(os.path.abspath(path))
    folder = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    temporary = TEMPORARY.format(name=name)
    try:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary, dir_fd=folder)  # left by a writer that was killed
        descriptor = os.open(
            temporary,
            os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
            mode,
            dir_fd=folder,
        )
        try:
            os.fchmod(descriptor, mode)
            view = memoryview(data)
            while view:
                view = view[os.write(descriptor, view) :]
            os.fsync(descriptor)
        finally:
            os.close(descriptor)
        try:
            os.link(temporary, name, src_dir_fd=folder, dst_dir_fd=folder, follow_symlinks=False)
        finally:
            os.unlink(temporary, dir_fd=folder)
        os.fsync(folder)
    finally:
        os.close(folder)


def install(source, path, mode):
    """Put the file ``source`` (made beside ``path`` by a tool, e.g. luksHeaderBackup) in the
    place of ``path``: its mode set, synced, renamed over it, the directory synced."""
    descriptor = os.open(source, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        os.fchmod(descriptor, mode)
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
    os.replace(source, path)
    folder = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


@contextlib.contextmanager
def exclusive(name, timeout, dir_fd, poll=0.5):
    """Hold an exclusive ``flock`` on file ``name`` in the directory open as ``dir_fd`` while the
    block runs; yields whether it was had within ``timeout`` seconds. The file must be a regular
    file of this user (no symlink) and is kept 0600, so nobody else can open it and hold the lock.
    A holder that dies lets go (the kernel drops its lock with its descriptor)."""
    descriptor = os.open(name, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
    try:
        info = os.fstat(descriptor)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
            raise PermissionError(f"{name} is not a regular file of this user (uid {info.st_uid})")
        os.fchmod(descriptor, 0o600)
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
                held = True
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    held = False
                    break
                time.sleep(poll)
        yield held
    finally:
        os.close(descriptor)


def proc_pid():
    """This process's pid as the mounted /proc knows it (its ``self`` link): what a /proc path
    of this process must name. Not os.getpid() in a PID namespace that shares its parent's /proc
    (a container run with --pid and the host's /proc)."""
    return os.readlink("/proc/self")


def fd_path(fd):
    """``/proc/<pid>/fd/<fd>``: this process's descriptor ``fd`` as a path another process can
    open (proc_pid)."""
    return f"/proc/{proc_pid()}/fd/{fd}"


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
        yield fd_path(copy)
    finally:
        os.close(copy)
