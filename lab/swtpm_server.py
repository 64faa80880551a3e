"""A real TPM 2.0 for the host-side tests: swtpm (Debian's swtpm) on loopback TCP, its state in a
directory of its own, started with TPM2_Startup done (as firmware does). Clevis and tpm2-tools
reach it through the ``TPM2TOOLS_TCTI`` of ``env`` (libtss2-tcti-swtpm). The lab guest gets its
TPM from QEMU instead (hana_lab.Lab(tpm=True))."""

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

from tang_server import free_port


def free_pair():
    """A free loopback port whose next port is free too."""
    for _ in range(50):
        port = free_port()
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no two free ports in a row on 127.0.0.1")


class SwtpmMissing(RuntimeError):
    pass


class SwtpmServer:
    """``with SwtpmServer(directory) as tpm``: ``tpm.env`` (the environment for Clevis and
    tpm2-tools), ``tpm.extend(pcr)`` (a measurement, as a boot component would make)."""

    def __init__(self, directory):
        missing = [n for n in ("swtpm", "tpm2_pcrextend", "clevis-encrypt-tpm2") if not shutil.which(n)]
        if missing:
            raise SwtpmMissing(
                f"a software TPM needs {', '.join(missing)}: run make deps (swtpm, tpm2-tools, clevis-tpm2)"
            )
        self.state = Path(directory) / "swtpm"
        self.state.mkdir(parents=True, exist_ok=True)
        self.port = free_pair()
        self.env = {**os.environ, "TPM2TOOLS_TCTI": f"swtpm:host=127.0.0.1,port={self.port}"}
        self.process = None

    def __enter__(self):
        control = self.port + 1  # where the swtpm TCTI looks for the control channel
        self.process = subprocess.Popen(
            ["swtpm", "socket", "--tpm2", "--tpmstate", f"dir={self.state}",
             "--server", f"type=tcp,port={self.port},bindaddr=127.0.0.1",
             "--ctrl", f"type=tcp,port={control},bindaddr=127.0.0.1",
             "--flags", "not-need-init,startup-clear"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )  # fmt: skip
        deadline = time.monotonic() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return self
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    err = self.process.communicate()[1] if self.process.poll() is not None else b""
                    self.stop()
                    raise RuntimeError(f"swtpm did not start: {err.decode(errors='replace')[:300]}") from None
                time.sleep(0.1)

    def __exit__(self, *exc):
        self.stop()

    def stop(self):
        if self.process and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def run(self, *argv, stdin=None):
        done = subprocess.run(list(argv), input=stdin, capture_output=True, env=self.env, check=False)
        # no resource manager between the tools and this TPM (a host has the kernel's, /dev/tpmrm0):
        # what a command left loaded would fill the TPM's few session and object slots
        for what in ("--transient-object", "--loaded-session", "--saved-session"):
            subprocess.run(["tpm2_flushcontext", what], capture_output=True, env=self.env, check=False)
        return done

    def extend(self, pcr, bank="sha256"):
        """Extend ``pcr`` with a digest no boot makes: the policies sealed to it fail from now on."""
        digest = "ab" * {"sha1": 20, "sha256": 32, "sha384": 48, "sha512": 64}[bank]
        done = self.run("tpm2_pcrextend", f"{pcr}:{bank}={digest}")
        assert done.returncode == 0, done.stderr

    def pcrs(self, bank, ids):
        done = self.run("tpm2_pcrread", f"{bank}:{','.join(map(str, ids))}")
        assert done.returncode == 0, done.stderr
        return done.stdout.decode()
