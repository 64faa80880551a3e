"""A real Tang server (tangd from the tang package) on the host's loopback, for the tests and the
lab: keys in a directory of its own, one tangd per connection (socat, as systemd's tangd.socket
does), never on any address but 127.0.0.1 (the lab guest reaches it as 10.0.2.2)."""

import base64
import hashlib
import json
import shutil
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

TANGD = Path("/usr/libexec/tangd")
KEYGEN = Path("/usr/libexec/tangd-keygen")
ROTATE = Path("/usr/libexec/tangd-rotate-keys")


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class TangMissing(RuntimeError):
    pass


def thumbprint(jwk):
    """RFC 7638 SHA-256 thumbprint, base64url: what tang-show-keys prints and Tang names files by."""
    canonical = json.dumps(
        {m: jwk[m] for m in ("crv", "kty", "x", "y")}, separators=(",", ":"), sort_keys=True
    )
    return base64.urlsafe_b64encode(hashlib.sha256(canonical.encode()).digest()).rstrip(b"=").decode()


class TangServer:
    """``with TangServer(directory) as tang``: ``tang.url`` (on the host), ``tang.guest_url``
    (from the lab guest), ``tang.thumbprint`` (its signing key), ``tang.rotate()``, ``tang.stop()``."""

    def __init__(self, directory):
        missing = [str(p) for p in (TANGD, KEYGEN) if not p.exists()] + [
            name for name in ("socat",) if not shutil.which(name)
        ]
        if missing:
            raise TangMissing(
                f"a Tang server needs {', '.join(missing)}: run make deps (packages tang, socat)"
            )
        self.keys = Path(directory) / "tang-keys"
        self.keys.mkdir(parents=True, exist_ok=True)
        if not self._advertised():
            subprocess.run([str(KEYGEN), str(self.keys)], check=True, capture_output=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.guest_url = f"http://10.0.2.2:{self.port}"
        self.process = None

    @property
    def thumbprint(self):
        """The signing key's thumbprint of the keys Tang advertises (not the rotated-away ones)."""
        for path in self._advertised():
            jwk = json.loads(path.read_text())
            if "sign" in jwk.get("key_ops", []):
                return thumbprint(jwk)
        raise RuntimeError(f"no signing key in {self.keys}")

    def _advertised(self):
        """Key files Tang advertises: rotated-away keys are kept hidden ('.'-prefixed)."""
        return sorted(p for p in self.keys.glob("*.jwk") if not p.name.startswith("."))

    def start(self):
        listen = f"TCP-LISTEN:{self.port},bind=127.0.0.1,reuseaddr,fork"
        self.process = subprocess.Popen(
            ["socat", listen, f"EXEC:{TANGD} {self.keys}"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        deadline = time.monotonic() + 10
        while True:
            try:
                with urllib.request.urlopen(f"{self.url}/adv", timeout=2) as answer:
                    json.load(answer)
                return self
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    error = self.process.stderr.read().decode() if self.process.poll() is not None else ""
                    self.stop()
                    raise RuntimeError(f"tangd on {self.url} did not answer: {error or 'timeout'}") from None
                time.sleep(0.1)

    def stop(self):
        if self.process and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=10)
        self.process = None

    def rotate(self):
        """New keys; the old ones stay (hidden, '.'-prefixed) so existing bindings still unlock."""
        subprocess.run([str(ROTATE), "-d", str(self.keys)], check=True, capture_output=True)

    def forget_rotated(self):
        """Delete the rotated-away keys, as an admin does once every binding should have moved to
        the new ones: a binding still made with them no longer unlocks."""
        for path in self.keys.glob(".*.jwk"):
            path.unlink()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
