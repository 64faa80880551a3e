"""An ``os`` for the host module in which one path is a block device (a probe of an image file
or of nothing at all): ``exists``, ``realpath`` and ``stat`` answer for it, everything else is
the real ``os``."""

import os
import stat
import types


def os_with_block_device(device, major, minor):
    real_os = os

    class FakePath:
        def __getattr__(self, attr):
            return getattr(real_os.path, attr)

        @staticmethod
        def exists(path):
            return path == device or real_os.path.exists(path)

        @staticmethod
        def realpath(path):
            return path if path == device else real_os.path.realpath(path)

    class FakeOs(types.SimpleNamespace):
        path = FakePath()

        def __getattr__(self, attr):
            return getattr(real_os, attr)

        @staticmethod
        def stat(path):
            if path == device:
                return types.SimpleNamespace(
                    st_mode=stat.S_IFBLK | 0o660, st_rdev=real_os.makedev(major, minor)
                )
            return real_os.stat(path)

    return FakeOs()
