"""What the beacon watches, read without ever blocking: block-device uevents (pyroute2 binds the
socket to the kernel's uevent group and parses each datagram) and mount-table changes (the kernel
flags ``/proc/self/mountinfo`` with POLLPRI; a mount sends no uevent). Sockets and /proc, no Salt.
"""

import errno
import logging
import os
import select
import socket
import threading

from . import events, tab

log = logging.getLogger(__name__)

DRAIN_LIMIT = 10000  # datagrams read per tick at most; more waiting counts as lost (a full audit)


def uevent_socket():
    """(pyroute2's uevent parser, a datagram socket bound to the kernel's uevent group).

    pyroute2 binds in a thread of its own: its sync API runs an asyncio loop, which cannot nest in
    the minion's running one, and it keeps the socket (and that loop) per thread. So that thread
    takes a duplicate of the bound socket and closes pyroute2's object, loop and all, itself:
    nothing of pyroute2 is left open but the parser, and closing the duplicate closes the socket.
    """
    # imported here, when a watch binds: every loader module imports this package
    from pyroute2 import UeventSocket  # noqa: PLC0415
    from pyroute2.netlink.uevent import MONITOR_GROUP_KERNEL  # noqa: PLC0415

    made = {}

    def make():
        try:
            uevents = UeventSocket()
            try:
                uevents.bind(groups=MONITOR_GROUP_KERNEL)
                bound = uevents.asyncore.socket
                made["socket"] = socket.socket(fileno=os.dup(bound.fileno()))
                made["marshal"] = uevents.marshal
            finally:
                uevents.close()
        except Exception as error:  # noqa: BLE001 - handed to the caller below
            made["error"] = error
            if "socket" in made:
                made.pop("socket").close()

    thread = threading.Thread(target=make, name="hana_storage-uevents")
    thread.start()
    thread.join()
    if "error" in made:
        raise OSError(f"cannot bind a uevent socket: {made['error']}")
    if made["socket"].getsockname()[1] != MONITOR_GROUP_KERNEL:
        name = made["socket"].getsockname()
        made["socket"].close()
        raise OSError(f"uevent socket bound to {name}, not the kernel group")
    return made["marshal"], made["socket"]


class KernelWatch:
    """Block uevents and mount-table changes, read without ever blocking.

    pyroute2 binds the uevent socket (kernel group) and parses each datagram; the datagrams are
    read here with MSG_DONTWAIT, because UeventSocket.get() waits for the next event.
    """

    def __init__(self, uevents):
        self.marshal, self.socket = uevent_socket() if uevents else (None, None)
        try:
            self.mountinfo = open("/proc/self/mountinfo", "rb")  # noqa: SIM115 - kept open across ticks
        except OSError:
            self.close()
            raise
        self.poller = select.poll()
        self.poller.register(self.mountinfo, select.POLLPRI | select.POLLERR)

    def drain(self):
        """(kernel names of block devices that changed, mount table changed?, events lost?).

        ENOBUFS: the kernel dropped uevents nobody read in time (the socket's buffer was full). It
        is reported once, by the next read; what was queued after the loss is read (and dropped:
        the full audit a loss starts covers every device) until the socket is empty.
        """
        devices, lost, reads = set(), False, 0
        while self.socket is not None:
            if reads >= DRAIN_LIMIT:
                lost = True  # events keep coming faster than a tick reads them: audit everything
                log.warning("hana_storage beacon: over %d uevents in one tick; a full audit follows", reads)
                break
            reads += 1
            try:
                datagram = self.socket.recv(65536, socket.MSG_DONTWAIT)
            except BlockingIOError:
                break
            except OSError as error:
                if error.errno != errno.ENOBUFS:
                    raise
                if not lost:
                    log.warning("hana_storage beacon: uevents lost (ENOBUFS); a full audit follows")
                lost = True
                continue
            if lost:
                continue
            for message in self.marshal.parse(datagram):
                name = events.uevent_device(message)
                if name:
                    devices.add(name)
        mounts_changed = bool(self.poller.poll(0))
        if mounts_changed:
            self.mountinfo.seek(0)
            self.mountinfo.read()  # re-arms the notification
        return devices, mounts_changed, lost

    def close(self):
        """Release the uevent socket and the mountinfo descriptor (more than once is fine)."""
        if self.socket is not None:
            self.socket.close()
        mountinfo = getattr(self, "mountinfo", None)
        if mountinfo is not None:
            mountinfo.close()


def read_mounts(warned):
    """The mount table, for change detection only (the audit judges the mounts itself).

    Bytes, so a mount point that is not UTF-8 breaks nothing; a line that does not parse is left
    out with a warning (once per distinct problem: ``warned``, a set the caller keeps): the HANA
    mountpoint it may hold then reads as changed, and the audit of that volume says what is wrong.
    """
    with open("/proc/self/mountinfo", "rb") as handle:
        raw = handle.read()
    malformed = []
    mounts = tab.parse_mountinfo(raw, malformed=malformed)
    for entry in malformed:
        if entry["error"] not in warned and len(warned) < 100:
            warned.add(entry["error"])
            log.warning("hana_storage beacon: %s; the line is left out", entry["error"])
    return mounts
