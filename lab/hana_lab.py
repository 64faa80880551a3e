"""The lab: a real Linux kernel under QEMU (virtme-ng) with sparse virtual disks.

One boot serves a whole scenario. The guest runs a small shell agent that executes command files
dropped into a shared read/write directory, so the host can run step after step in one boot and
read each step's exit code and output (streamed while it runs):

    with Lab(disks=8) as vm:
        vm.run("cryptsetup --version")
        vm.salt_call("hana_storage.validate_pillar")

Disk images live in the lab directory and survive the VM, so booting again on the same directory
is a reboot. The guest sees the host's filesystem read-only, with writable overlays on /etc and
/hana and tmpfs on /run (where Salt's root_dir goes: 9p refuses sockets).
"""

import contextlib
import glob
import os
import pathlib
import shlex
import shutil
import subprocess
import sys
import time

REPO = pathlib.Path(__file__).resolve().parent.parent
DEFAULT_DIR = REPO / "build" / "lab"
VENV_BIN = REPO / ".venv" / "bin"

AGENT = r"""#!/bin/sh
# In-guest agent: run cmd.N files in order, write out.N and rc.N; stop on 'quit'.
dir="$1"
modprobe -a dm-mod dm-crypt dm-snapshot xfs >"$dir/modprobe.log" 2>&1
mkdir -p /run/lock /run/lvm /run/cryptsetup
n=0
touch "$dir/ready"
while :; do
  if [ -f "$dir/cmd.$n" ]; then
    sh "$dir/cmd.$n" >"$dir/out.$n" 2>&1 </dev/null
    echo $? >"$dir/rc.$n.tmp" && mv "$dir/rc.$n.tmp" "$dir/rc.$n"
    n=$((n+1))
  elif [ -f "$dir/quit" ]; then
    sync; exit 0
  else
    sleep 0.1
  fi
done
"""

GUEST_ENV = f"""set -u
export PATH={VENV_BIN}:/usr/sbin:/usr/bin:/sbin:/bin
export LVM_SUPPRESS_FD_WARNINGS=1 PYTHONDONTWRITEBYTECODE=1
cd /run
"""


class LabError(RuntimeError):
    """The lab could not do what was asked; the message names the cause and the log to read."""


class Result:
    def __init__(self, command, rc, output, seconds):
        self.command, self.rc, self.output, self.seconds = command, rc, output, seconds

    @property
    def ok(self):
        return self.rc == 0

    def __repr__(self):
        return f"Result(rc={self.rc}, {self.seconds:.1f}s, {self.command[:60]!r})"


def say(message):
    print(f"[lab {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def find_kernel():
    """The host's generic Debian kernel (the -cloud- flavour lacks 9p)."""
    kernels = sorted(k for k in glob.glob("/boot/vmlinuz-*") if "cloud" not in k)
    if not kernels:
        raise LabError("no kernel in /boot: install the Debian package linux-image-amd64 (make deps does)")
    return kernels[-1]


class Lab:
    def __init__(
        self,
        disks=8,
        disk_size="2G",
        workdir=DEFAULT_DIR,
        memory="2G",
        cpus=2,
        boot_timeout=300,
        fresh=True,
        verbose=True,
    ):
        self.disks, self.disk_size = disks, disk_size
        self.workdir = pathlib.Path(workdir)
        self.memory, self.cpus = memory, cpus
        self.boot_timeout, self.fresh, self.verbose = boot_timeout, fresh, verbose
        self.shared = self.workdir / "shared"
        self.console = self.workdir / "console.log"
        self.proc = None
        self.step = 0

    # ---- disks -------------------------------------------------------------------------
    def disk_paths(self):
        return [self.workdir / f"disk{i}.img" for i in range(self.disks)]

    def guest_disk(self, index):
        """Guest device of disk N: virtio disks appear in order as /dev/vda, /dev/vdb, ..."""
        return "/dev/vd" + "abcdefghijklmnopqrstuvwxyz"[index]

    def _make_disks(self):
        self.workdir.mkdir(parents=True, exist_ok=True)
        for path in self.disk_paths():
            if self.fresh or not path.exists():
                path.unlink(missing_ok=True)
                subprocess.run(["truncate", "-s", self.disk_size, str(path)], check=True)

    # ---- boot / shutdown ---------------------------------------------------------------
    def start(self):
        vng = shutil.which("vng", path=f"{VENV_BIN}:{os.environ.get('PATH', '')}")
        if not vng or not shutil.which("qemu-system-x86_64"):
            raise LabError(
                "virtme-ng or qemu missing: run 'make deps' (installs qemu-system-x86 and the venv)"
            )
        kernel = find_kernel()
        self._make_disks()
        shutil.rmtree(self.shared, ignore_errors=True)
        self.shared.mkdir(parents=True)
        (self.shared / "agent.sh").write_text(AGENT)
        os.makedirs("/hana", exist_ok=True)  # --overlay-rwdir needs the directory on the host
        drives = " ".join(f"-drive file={p},format=raw,if=virtio,cache=unsafe" for p in self.disk_paths())
        cmd = [
            vng,
            "--run",
            kernel,
            "--disable-kvm",
            "--memory",
            self.memory,
            "--cpus",
            str(self.cpus),
            "--rwdir",
            str(self.shared),
            "--overlay-rwdir",
            "/etc",
            "--overlay-rwdir",
            "/hana",
            f"--qemu-opts={drives}",
            "--exec",
            f"sh {self.shared}/agent.sh {self.shared}",
        ]
        env = dict(os.environ, PATH=f"{VENV_BIN}:{os.environ.get('PATH', '')}")
        say(
            f"booting {os.path.basename(kernel)} with {self.disks} x {self.disk_size} disks "
            f"(software emulation, usually 20-60 s) - console log: {self.console}"
        )
        log = open(self.console, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd="/",
            start_new_session=True,
        )
        self._log = log
        started = time.monotonic()
        while not (self.shared / "ready").exists():
            if self.proc.poll() is not None:
                raise LabError(f"the VM exited during boot (rc {self.proc.returncode}); read {self.console}")
            if time.monotonic() - started > self.boot_timeout:
                self.stop()
                raise LabError(f"the VM did not come up within {self.boot_timeout}s; read {self.console}")
            time.sleep(0.5)
        say(f"VM up after {time.monotonic() - started:.0f}s")
        return self

    def stop(self):
        if not self.proc:
            return
        (self.shared / "quit").touch()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, 9)
            self.proc.wait()
        self._log.close()
        self.proc = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    # ---- commands ----------------------------------------------------------------------
    def run(self, script, timeout=900, check=False, title=None, echo=None):
        """Run a shell script in the guest; returns Result. Output streams to stderr if echo."""
        if not self.proc:
            raise LabError("the VM is not running")
        echo = self.verbose if echo is None else echo
        n = self.step
        self.step += 1
        tmp = self.shared / f".cmd.{n}"
        tmp.write_text(GUEST_ENV + script + "\n")
        tmp.rename(self.shared / f"cmd.{n}")
        if title:
            say(title)
        out, rc_file = self.shared / f"out.{n}", self.shared / f"rc.{n}"
        started, shown = time.monotonic(), 0
        while True:
            done = rc_file.exists()
            if echo and out.exists():
                text = out.read_text(errors="replace")
                if len(text) > shown:
                    sys.stderr.write(text[shown:])
                    sys.stderr.flush()
                    shown = len(text)
            if done:
                break
            if self.proc.poll() is not None:
                raise LabError(f"the VM died while running step {n}; read {self.console} and {out}")
            if time.monotonic() - started > timeout:
                raise LabError(f"step {n} took more than {timeout}s; its output so far is in {out}")
            time.sleep(0.2)
        result = Result(
            script,
            int(rc_file.read_text().strip() or 1),
            out.read_text(errors="replace"),
            time.monotonic() - started,
        )
        if check and not result.ok:
            raise LabError(
                f"step {n} failed with rc {result.rc}: {script.splitlines()[0][:80]}\n{result.output[-2000:]}"
            )
        return result

    def write(self, guest_path, text, mode=0o644):
        """Write a file inside the guest (through the shared directory)."""
        name = f"file.{self.step}"
        (self.shared / name).write_text(text)
        self.run(
            f"install -D -m {mode:o} {self.shared}/{name} {shlex.quote(guest_path)} && rm {self.shared}/{name}",
            check=True,
            echo=False,
        )

    # ---- Salt inside the guest --------------------------------------------------------
    def setup_salt(self, pillar_yaml, minion_id="lab"):
        """A masterless minion in the guest: root_dir on tmpfs, the formula as file_roots."""
        self.write("/run/salt/pillar/top.sls", "base:\n  '*':\n    - hana\n")
        self.write("/run/salt/pillar/hana.sls", pillar_yaml, mode=0o600)
        self.write("/run/salt/etc/minion", MINION_CONFIG.format(repo=REPO, id=minion_id))
        return self.salt_call("saltutil.sync_all", title="syncing the formula's custom modules")

    def salt_call(self, args, check=False, title=None, out="json", timeout=1200, echo=None):
        cmd = f"salt-call -c /run/salt/etc --out={out} --log-level=warning {args}"
        return self.run(cmd, check=check, title=title or f"salt-call {args}", timeout=timeout, echo=echo)


MINION_CONFIG = """id: {id}
file_client: local
root_dir: /run/salt/root
pki_dir: /run/salt/pki
cachedir: /run/salt/cache
sock_dir: /run/salt/sock
log_file: /run/salt/minion.log
log_level_logfile: debug
file_roots:
  base:
    - {repo}/salt
    - {repo}
pillar_roots:
  base:
    - /run/salt/pillar
"""


@contextlib.contextmanager
def lab(**kwargs):
    vm = Lab(**kwargs)
    try:
        yield vm.start()
    finally:
        vm.stop()
