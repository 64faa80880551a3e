"""The lab: a real Linux kernel under QEMU (virtme-ng) with sparse virtual disks.

One boot serves a whole scenario. The guest runs a small shell agent that executes command files
dropped into a shared read/write directory, so the host can run step after step in one boot and
read each step's exit code and output (streamed while it runs):

    with Lab(disks=8) as vm:
        vm.run("cryptsetup --version")
        vm.salt_call("hana_storage.validate_pillar")

Disk images live in the lab directory and survive the VM, so booting again on the same directory
is a reboot. The guest sees the host's filesystem read-only, with writable overlays on /etc,
/hana and the formula's SCAP directories, and tmpfs on /run (where Salt's root_dir goes: its sockets cannot live on the shared root).
"""

import base64
import contextlib
import fcntl
import glob
import hashlib
import importlib.util
import json
import os
import pathlib
import shlex
import shutil
import socket
import subprocess
import sys
import threading
import time

REPO = pathlib.Path(__file__).resolve().parent.parent
DEFAULT_DIR = REPO / "build" / "lab"
# Lab VMs running at once on this machine, machine-wide: each emulated guest keeps about one core
# busy. ``make test`` runs two lanes of VM modules on two cores; by hand, one at a time.
LOCK = "/tmp/hana-storage-lab.lock"  # .<slot> for each slot
SLOTS = max(1, int(os.environ.get("HANA_STORAGE_LAB_SLOTS", "1")))
# The guest runs the Salt of the venv the lab runs from (make test-vm runs the events test on the
# oldest Salt line's venv); run outside a venv, the newest line's .venv.
VENV = pathlib.Path(sys.prefix) if sys.prefix != sys.base_prefix else REPO / ".venv"
VENV_BIN = VENV / "bin"
# The guest's root and shared directories over virtio-fs, whose guest keeps a page cache of what
# it read (lab/bin/virtiofsd fronts QEMU 7.2's daemon for virtme-ng; steps take about 0.8 of
# their time over 9p), or over 9p (HANA_STORAGE_LAB_ROOTFS=9p).
ROOTFS = os.environ.get("HANA_STORAGE_LAB_ROOTFS", "virtiofs")
LAB_BIN = REPO / "lab" / "bin"

AGENT = r"""#!/bin/sh
# In-guest agent: run cmd.N files in order, write out.N and rc.N; stop on 'quit'.
dir="$1"
modprobe -a dm-mod dm-crypt dm-snapshot xfs ext4 virtio_scsi sd_mod loop >"$dir/modprobe.log" 2>&1
# The Python runtime comes on a SCSI disk (ext4), out of the way of the lab's /dev/vd* disks:
# imports over the 9p root cost minutes.
rt=/dev/sda; i=0
while [ ! -b "$rt" ] && [ $i -lt 100 ]; do sleep 0.1; i=$((i+1)); done
mkdir -p /run/rt && mount -o ro "$rt" /run/rt \
  && mount --bind /run/rt/pyenv "@PYROOT@" && mount --bind /run/rt/venv "@VENV@" \
  || echo "runtime disk $rt not mounted: Python will be slow" >>"$dir/modprobe.log"
mkdir -p /run/lock /run/lvm /run/cryptsetup
# virtme-ng bind-mounts a file of its own on /etc/fstab, and a mount point cannot be renamed
# over (EBUSY): the formula replaces fstab whole, as on a real host. Its content stays.
if grep -q ' /etc/fstab ' /proc/self/mountinfo; then
  cp /etc/fstab /run/fstab.virtme && umount /etc/fstab && cat /run/fstab.virtme >/etc/fstab
fi
n=0
touch "$dir/ready"
while :; do
  if [ -f "$dir/cmd.$n" ] && [ -f /run/lab-systemd.pid ]; then
    # inside the PID namespace of the guest's systemd (start_service_manager): systemctl and
    # systemd-run reach it only from there. Outside it they fail with "Failed to connect to
    # bus", so a namespace that is gone (or a PID now someone else's) is said, not run in.
    pid=$(cat /run/lab-systemd.pid)
    if [ "$(cat /proc/$pid/comm 2>/dev/null)" = systemd ] \
       && [ "$(readlink /proc/$pid/ns/pid)" != "$(readlink /proc/self/ns/pid)" ]; then
      nsenter -t "$pid" -p sh "$dir/cmd.$n" >"$dir/out.$n" 2>&1 </dev/null
      echo $? >"$dir/rc.$n.tmp"
    else
      { echo "the lab's systemd (pid $pid) is gone: read /run/lab-systemd.log"
        tail -n 20 /run/lab-systemd.log; } >"$dir/out.$n" 2>&1
      echo 125 >"$dir/rc.$n.tmp"
    fi
    mv "$dir/rc.$n.tmp" "$dir/rc.$n"
    n=$((n+1))
  elif [ -f "$dir/cmd.$n" ]; then
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

HOST_FROM_GUEST = "10.0.2.2"  # QEMU user networking's gateway: the host's loopback
CRACKLIB = "/var/cache/cracklib"
GUEST_ENV = f"""set -u
export PATH={VENV_BIN}:/usr/sbin:/usr/bin:/sbin:/bin
export LVM_SUPPRESS_FD_WARNINGS=1 PYTHONDONTWRITEBYTECODE=1
cd /run
"""


def python_root():
    """The interpreter installation the venv was made from (pyvenv.cfg 'home' is its bin/)."""
    for line in (VENV_BIN.parent / "pyvenv.cfg").read_text().splitlines():
        key, _, value = line.partition("=")
        if key.strip() == "home":
            return pathlib.Path(value.strip()).resolve().parent
    raise LabError("no 'home' in .venv/pyvenv.cfg: recreate the venv with 'make deps'")


def runtime_image():
    """An ext4 image holding the interpreter and the venv, rebuilt when requirements change; by one
    lab at a time (the lanes of make test boot side by side)."""
    (REPO / "build").mkdir(exist_ok=True)
    with open(REPO / "build" / f"lab-runtime{VENV.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _runtime_image()


def _runtime_image():
    image = REPO / "build" / f"lab-runtime{VENV.name}.img"
    stamp = image.with_suffix(".stamp")
    pyroot = python_root()
    want = f"{pyroot}\n{VENV}\n{sorted(p.name for p in VENV.glob('.lock-*'))}"
    if image.exists() and stamp.exists() and stamp.read_text() == want:
        return image
    say(f"building the lab's Python runtime disk from {VENV.name} (once per lock)")
    staging = REPO / "build" / f"lab-runtime{VENV.name}.d"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    for src, dest in ((pyroot, "pyenv"), (VENV_BIN.parent, "venv")):
        # hard links: no copy when build/ shares the filesystem, a plain copy otherwise
        if subprocess.run(["cp", "-al", str(src), str(staging / dest)], capture_output=True).returncode:
            subprocess.run(["cp", "-a", str(src), str(staging / dest)], check=True)
    lib = staging / "pyenv" / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}"
    for unused in ("site-packages", "test"):
        shutil.rmtree(lib / unused, ignore_errors=True)
    image.unlink(missing_ok=True)
    subprocess.run(["truncate", "-s", "3G", str(image)], check=True)
    subprocess.run(["mkfs.ext4", "-q", "-F", "-L", "hanart", "-d", str(staging), str(image)], check=True)
    shutil.rmtree(staging)
    stamp.write_text(want)
    return image


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


def guest_cpus():
    """vCPUs per guest: HANA_STORAGE_LAB_CPUS, else the host's cores shared by the lab slots
    (at most 2). Each vCPU is a host thread under emulation; more of them than cores and a vCPU
    spins on a lock whose holder's thread is not running. Two VM modules side by side on two
    cores with 2 vCPUs each took 24.6 (enforce) and 23.1 min (grow); with 1 vCPU each 10.6 and
    12.0 min, enforce as fast as alone with 2 (10.2 min). Alone, 2 vCPUs let the guest's
    background work (a kill watcher, the argv sampler) run beside the apply."""
    if os.environ.get("HANA_STORAGE_LAB_CPUS"):
        return max(1, int(os.environ["HANA_STORAGE_LAB_CPUS"]))
    return max(1, min(2, (os.cpu_count() or 1) // SLOTS))


def _lab_slot():
    """Hold one of the SLOTS lab slots (a lock file each) until the returned file is closed."""
    waited = False
    while True:
        for slot in range(SLOTS):
            handle = open(f"{LOCK}.{slot}", "w")  # noqa: SIM115 - the caller closes it
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return handle
            except BlockingIOError:
                handle.close()
        if not waited:
            say(f"{SLOTS} lab VM(s) already run on this machine; waiting for one to end ({LOCK}.*)")
            waited = True
        time.sleep(2)


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
        cpus=None,
        boot_timeout=300,
        fresh=True,
        verbose=True,
        network=False,
        paths=1,
        cpu=None,
        tpm=False,
        fips=False,
    ):
        self.disks, self.disk_size = disks, disk_size
        # paths=2: every disk image is attached twice, both with the serial lun<N>, as a SAN LUN
        # reaches a host over two paths: the first paths are vda.., the second follow them
        self.paths = paths
        self.workdir = pathlib.Path(workdir).resolve()
        self.memory, self.cpus = memory, cpus or guest_cpus()
        self.boot_timeout, self.fresh, self.verbose = boot_timeout, fresh, verbose
        self.network = network  # user-mode networking: the host is 10.0.2.2 from the guest
        # QEMU's CPU model; virtme-ng's "max" emulates AES-NI, "max,aes=off" a CPU without it
        self.cpu = cpu
        # a TPM 2.0 (swtpm, its state under the lab directory) behind QEMU's tpm-tis device: the
        # guest's /dev/tpm0 and /dev/tpmrm0, as a vTPM (PowerVM, NitroTPM, Azure, GCP) gives a host
        self.tpm, self.swtpm = tpm, None
        # the kernel in FIPS mode (fips=1): /proc/sys/crypto/fips_enabled says 1 and the kernel's
        # crypto runs its self-tests and refuses what FIPS forbids, as on a FIPS host
        self.fips = fips
        self.shared = self.workdir / "shared"
        self.console = self.workdir / "console.log"
        self.qmp = self.workdir / "qmp.sock"
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
        self._lock = _lab_slot()
        self._kill_stale_vm()
        self._make_disks()
        if self.fresh:
            (self.workdir / "steps.tsv").unlink(missing_ok=True)
        shutil.rmtree(self.shared, ignore_errors=True)
        self.shared.mkdir(parents=True)
        agent = AGENT.replace("@PYROOT@", str(python_root())).replace("@VENV@", str(VENV_BIN.parent))
        (self.shared / "agent.sh").write_text(agent)
        runtime = runtime_image()
        for directory in ("/hana", *SCAP_DIRS):  # --overlay-rwdir needs the directory on the host
            os.makedirs(directory, exist_ok=True)
        if self.paths == 1:
            drives = " ".join(
                f"-drive file={p},format=raw,if=virtio,cache=unsafe,id=d{i}p0"
                for i, p in enumerate(self.disk_paths())
            )
        else:
            drives = " ".join(
                f"-drive file={p},format=raw,if=none,id=d{i}p{n},cache=unsafe,file.locking=off "
                f"-device virtio-blk-pci,drive=d{i}p{n},share-rw=on,serial=lun{i}"
                for n in range(self.paths)
                for i, p in enumerate(self.disk_paths())
            )
        drives += (
            f" -device virtio-scsi-pci,id=rtscsi -drive file={runtime},format=raw,if=none,id=rt,readonly=on"
            " -device scsi-hd,drive=rt,bus=rtscsi.0"
        )
        self.qmp.unlink(missing_ok=True)
        drives += f" -qmp unix:{self.qmp},server=on,wait=off"  # resize_disk: a LUN grown under the guest
        if self.cpu:
            drives += f" -cpu {self.cpu}"  # after virtme-ng's own -cpu: QEMU takes the last one
        if self.tpm:
            drives += self._start_tpm()
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
            # where the formula keeps its SCAP data stream and audit record (an apply writes them)
            *(a for d in SCAP_DIRS for a in ("--overlay-rwdir", d)),
            f"--qemu-opts={drives}",
            # the guest's /var/cache is empty: Clevis makes its keys with pwmake, which needs the
            # cracklib dictionary there
            *(["--rodir", CRACKLIB] if os.path.isdir(CRACKLIB) else []),
            *(["--network", "user"] if self.network else []),
            *(["--append", "fips=1"] if self.fips else []),
            "--exec",
            f"sh {self.shared}/agent.sh {self.shared}",
        ]
        tools = f"{VENV_BIN}:{LAB_BIN}" if ROOTFS == "virtiofs" else str(VENV_BIN)
        env = dict(os.environ, PATH=f"{tools}:{os.environ.get('PATH', '')}")
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
        (self.workdir / "vm.pid").write_text(str(self.proc.pid))  # its process group
        started = time.monotonic()
        while not (self.shared / "ready").exists():
            if self.proc.poll() is not None:
                raise LabError(f"the VM exited during boot (rc {self.proc.returncode}); read {self.console}")
            if time.monotonic() - started > self.boot_timeout:
                self.stop()
                raise LabError(f"the VM did not come up within {self.boot_timeout}s; read {self.console}")
            time.sleep(0.5)
        say(f"VM up after {time.monotonic() - started:.0f}s")
        self._record("boot", f"{self.disks} disks", time.monotonic() - started)
        if self.network:
            try:
                self._wait_for_network()
            except LabError:
                self.stop()
                raise
        return self

    def _wait_for_network(self):
        """The guest's DHCP lease. virtme-ng runs `udhcpc -n` once at boot, which gives up for
        good when its few discovers go unanswered (seen under a loaded TCG): ask again."""
        # the script virtme-ng's init runs, from the package vng runs from (the guest sees the host's /)
        script = (
            pathlib.Path(importlib.util.find_spec("virtme").origin).parent / "guest" / "virtme-udhcpc-script"
        )
        result = self.run(
            "for try in 1 2 3 4 5 6; do\n"
            "  i=0; while [ $i -lt 50 ]; do ip route | grep -q '^default' && exit 0; sleep 0.2; i=$((i+1)); done\n"
            '  echo "no lease yet (try $try): asking again"\n'
            "  for d in /sys/bus/virtio/drivers/virtio_net/virtio*/net/*; do\n"
            f"    busybox udhcpc -i $(basename $d) -n -q -f -t 5 -T 3 -s {script} || true\n"
            "  done\n"
            "done; exit 1",
            echo=False,
            title="waiting for the guest's network (DHCP)",
        )
        if not result.ok:
            raise LabError(f"the guest got no DHCP lease from QEMU user networking:\n{result.output[-1500:]}")

    def _kill_stale_vm(self):
        """A VM a killed test run left behind on this lab directory (the host's vng runs in a
        session of its own, so it outlives the process that started it): killed, with its QEMU."""
        pidfile = self.workdir / "vm.pid"
        try:
            pgid = int(pidfile.read_text())
            with open(f"/proc/{pgid}/cmdline", "rb") as handle:  # the same VM, not a pid reused since
                ours = str(self.shared).encode() in handle.read()
            if ours:
                os.killpg(pgid, 9)
                say(f"killed a VM left behind by an earlier run on {self.workdir} (process group {pgid})")
        except (OSError, ValueError):
            pass
        pidfile.unlink(missing_ok=True)

    def _start_tpm(self):
        """Start swtpm for the guest's TPM 2.0 and return QEMU's options for it. The firmware
        starts the TPM and measures the boot into its PCRs, as on a host; the state (keys, NV)
        lives in the lab directory for the lab's life (a fresh lab, a new TPM)."""
        if not shutil.which("swtpm"):
            raise LabError("a lab TPM needs swtpm: run make deps (Debian packages swtpm, swtpm-tools)")
        self._stop_tpm()  # a restarted guest: a new swtpm on the same state, as a power cycle
        state, sock = self.workdir / "tpm", self.workdir / "swtpm.sock"
        self._kill_stale_tpm(state)
        if self.fresh:
            shutil.rmtree(state, ignore_errors=True)
        state.mkdir(parents=True, exist_ok=True)
        sock.unlink(missing_ok=True)
        log = self.workdir / "swtpm.log"
        self.swtpm = subprocess.Popen(
            ["swtpm", "socket", "--tpm2", "--tpmstate", f"dir={state}", "--ctrl", f"type=unixio,path={sock}",
             "--log", f"file={log},level=1"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        (self.workdir / "swtpm.pid").write_text(str(self.swtpm.pid))
        deadline = time.monotonic() + 30
        while not sock.exists():
            if self.swtpm.poll() is not None or time.monotonic() > deadline:
                raise LabError(f"swtpm did not start (rc {self.swtpm.poll()}); read {log}")
            time.sleep(0.1)
        return f" -chardev socket,id=chrtpm,path={sock} -tpmdev emulator,id=tpm0,chardev=chrtpm -device tpm-tis,tpmdev=tpm0"

    def _kill_stale_tpm(self, state):
        """A swtpm a killed test run left behind on this lab directory (its own session, like the
        VM's): killed, so that two never serve one state."""
        pidfile = self.workdir / "swtpm.pid"
        try:
            pid = int(pidfile.read_text())
            with open(f"/proc/{pid}/cmdline", "rb") as handle:  # the same swtpm, not a pid reused since
                if str(state).encode() in handle.read():
                    os.kill(pid, 9)
        except (OSError, ValueError):
            pass
        pidfile.unlink(missing_ok=True)

    def _stop_tpm(self):
        if self.swtpm is not None:
            if self.swtpm.poll() is None:
                self.swtpm.terminate()
                try:
                    self.swtpm.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    self.swtpm.kill()
                    self.swtpm.wait()
            self.swtpm = None

    def stop(self):
        if not self.proc:
            self._stop_tpm()
            return
        self._command_times()
        self.stop_salt()
        (self.shared / "quit").touch()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, 9)
            self.proc.wait()
        self._release()

    def power_off(self):
        """Cut the guest's power: QEMU killed at once, nothing shut down or flushed. What the
        guest wrote reached the disk images; what it held in its page cache is lost."""
        say("cutting the guest's power (QEMU killed)")
        os.killpg(self.proc.pid, 9)
        self.proc.wait()
        self._release()

    def _release(self):
        """What a guest that ended leaves to free: its TPM, its log, its PID file and its lock."""
        self._stop_tpm()
        self._log.close()
        self.proc = None
        (self.workdir / "vm.pid").unlink(missing_ok=True)
        self._lock.close()

    @contextlib.contextmanager
    def _qmp(self):
        """A session on the running QEMU's QMP socket: yields ask(command, **arguments), which
        returns the command's answer."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as qmp:
            qmp.settimeout(60)
            qmp.connect(str(self.qmp))
            replies = qmp.makefile("r")

            def ask(command, **arguments):
                qmp.sendall(json.dumps({"execute": command, "arguments": arguments}).encode() + b"\n")
                while True:  # events come before the answer
                    reply = json.loads(replies.readline())
                    if "return" in reply:
                        return reply["return"]
                    if "error" in reply:
                        raise LabError(f"QMP {command} {arguments}: {reply['error']}")

            json.loads(replies.readline())  # the greeting
            ask("qmp_capabilities")
            yield ask

    def _drives(self, index):
        return [f"d{index}p{path}" for path in range(self.paths)]

    def resize_disk(self, index, size_bytes):
        """Grow lab disk N under the running guest, every path of it, as a SAN grows a LUN or a
        cloud a volume (QEMU's block_resize over its QMP socket): the guest sees the new size
        at once (virtio). The image file grows with it."""
        say(f"growing disk {index} ({self.guest_disk(index)}) to {size_bytes} bytes under the guest")
        with self._qmp() as ask:
            for drive in self._drives(index):
                ask("block_resize", device=drive, size=int(size_bytes))

    def throttle_writes(self, index, bytes_per_s):
        """Cap the guest's writes to lab disk N at ``bytes_per_s`` (QEMU's I/O throttling, every
        path; 0 lifts it): a write of a few MiB then takes seconds, and a power cut can land in
        the middle of it. A new boot starts unthrottled."""
        with self._qmp() as ask:
            for drive in self._drives(index):
                ask(
                    "block_set_io_throttle",
                    device=drive,
                    bps=0,
                    bps_rd=0,
                    bps_wr=int(bytes_per_s),
                    iops=0,
                    iops_rd=0,
                    iops_wr=0,
                )

    def written_bytes(self, indexes):
        """Bytes the guest wrote to the lab disks ``indexes`` since its boot, every path (QEMU's
        block statistics)."""
        with self._qmp() as ask:
            stats = ask("query-blockstats")
        drives = {drive for index in indexes for drive in self._drives(index)}
        return sum(s["stats"]["wr_bytes"] for s in stats if s.get("device") in drives)

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
        self._record("run", title or script.strip().splitlines()[0][:100], result.seconds)
        if check and not result.ok:
            raise LabError(
                f"step {n} failed with rc {result.rc}: {script.splitlines()[0][:80]}\n{result.output[-2000:]}"
            )
        return result

    def _command_times(self):
        """The guest's command log (lab/guest_caller.py), summed per program into steps.tsv."""
        if not (self.shared / "salt").is_dir():
            return
        try:
            text = self.run("cat /run/salt/commands.tsv 2>/dev/null", echo=False, timeout=60).output
        except LabError:
            return
        totals = {}
        for line in text.splitlines():
            name, _, seconds = line.partition("\t")
            count, spent = totals.get(name, (0, 0.0))
            totals[name] = (count + 1, spent + float(seconds or 0))
        for name, (count, spent) in sorted(totals.items(), key=lambda item: -item[1][1]):
            self._record("commands", f"{name} x{count}", spent)

    def _record(self, kind, what, seconds):
        """One line per step in <workdir>/steps.tsv: where a module's time goes."""
        with open(self.workdir / "steps.tsv", "a", encoding="utf-8") as log:
            log.write(f"{time.strftime('%H:%M:%S')}\t{kind}\t{seconds:.1f}\t{what}\n")

    def checksum(self, index):
        """sha256 of lab disk N as the guest left it, hashed on the host (native speed)."""
        self.run("sync", check=True, echo=False)
        digest = hashlib.sha256()
        with open(self.disk_paths()[index], "rb") as image:
            for block in iter(lambda: image.read(1 << 22), b""):
                digest.update(block)
        return digest.hexdigest()

    def clock(self):
        """How the guest's clocks stand against the host's (lab/guest_clock.py): {offset, error,
        realtime_minus_monotonic} in seconds, from UDP exchanges with a clock server on the host's
        loopback that lives for this call. Needs the guest's network."""
        stop = threading.Event()
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as server:
            server.bind(("127.0.0.1", 0))
            server.settimeout(0.2)

            def serve():
                while not stop.is_set():
                    try:
                        number, peer = server.recvfrom(64)
                    except TimeoutError:
                        continue
                    server.sendto(number + f" {time.time()!r}".encode(), peer)

            thread = threading.Thread(target=serve, name="lab-clock", daemon=True)
            thread.start()
            try:
                out = self.run(
                    f"python3 {REPO}/lab/guest_clock.py {HOST_FROM_GUEST} {server.getsockname()[1]}",
                    check=True,
                    echo=False,
                ).output
            finally:
                stop.set()
                thread.join()
        return json.loads(out.strip().splitlines()[-1])

    def write(self, guest_path, text, mode=0o644):
        """Write a file inside the guest (through the shared directory)."""
        name = f"file.{self.step}"
        (self.shared / name).write_text(text)
        dest = shlex.quote(guest_path)
        # written in place: a test may plant a file the formula must find as it was (a link's target)
        self.run(
            f"umask 077 && mkdir -p $(dirname {dest}) && cat {self.shared}/{name} >{dest} && chmod {mode:o} {dest} "
            f"&& rm {self.shared}/{name}",
            check=True,
            echo=False,
        )

    # ---- Salt inside the guest --------------------------------------------------------
    def key_b64(self):
        """The lab's LUKS key: random, made once per lab directory, so a reboot can unlock."""
        path = self.workdir / "lab.key.b64"
        if not path.exists():
            path.write_text(base64.b64encode(os.urandom(64)).decode())
            path.chmod(0o600)
        return path.read_text().strip()

    def pillar(self, template=REPO / "lab" / "pillar.sls.j2"):
        """The lab pillar (lab/pillar.sls.j2) rendered with the lab key."""
        return pathlib.Path(template).read_text().replace("{{ key_b64 }}", self.key_b64())

    def start_service_manager(self):
        """A real systemd service manager in the guest, for what the formula hands to systemd
        (``systemd-run`` units). virtme-ng's init is not systemd, and systemd runs as a system
        manager only as PID 1: it runs as PID 1 of a PID namespace, with a target that starts
        its journal and reaches sysinit.target (udev, and the crypttab and fstab the guest has
        now), as a booted host has, and no service; every later command of the lab (Salt's
        included) runs in that namespace, where systemctl reaches it. Without sysinit.target
        reached, the first transient unit (it requires it) waited for the boot's storage jobs:
        a minute and more of each apply that starts one."""
        say("starting systemd in the guest (a PID namespace of its own)")
        started = time.monotonic()
        self.write(
            "/etc/systemd/system/lab-minimal.target",
            "[Unit]\nDescription=lab: a service manager for transient units\n"
            "Wants=systemd-journald.service sysinit.target\nAfter=sysinit.target\n",
        )
        self.run(
            "setsid unshare --pid --fork --mount-proc /lib/systemd/systemd --system "
            "--unit=lab-minimal.target </dev/null >/run/lab-systemd.log 2>&1 &\n"
            "for i in $(seq 600); do\n"
            # PID 1 of the namespace: a child systemd forked but has not yet exec'd matches
            # its command line too, and lives only briefly
            "  pid=$(for p in $(pgrep -x systemd); do\n"
            "    awk -v p=$p '/^NSpid:/ && NF == 3 && $3 == 1 {print p}' /proc/$p/status; done)\n"
            '  state=$([ -n "$pid" ] && nsenter -t $pid -p systemctl is-system-running 2>/dev/null)\n'
            '  case "$state" in running|degraded) echo $pid >/run/lab-systemd.pid; exit 0;; esac\n'
            "  sleep 0.5\n"
            "done\n"
            "echo 'systemd did not come up: /run/lab-systemd.log' >&2; exit 1",
            check=True,
            echo=False,
        )
        self._record("systemd-start", "systemd in a PID namespace", time.monotonic() - started)

    def systemctl(self, args, check=True, title=None):
        """``systemctl <args>`` in the lab's service manager (start_service_manager). A refused
        bus connection is tried once more, and what the service manager said is kept in the
        step log: a CI run saw it once, and the lab's log had to tell why."""
        result = self.run(f"systemctl {args}", title=title, echo=False)
        if "Failed to connect to bus" in result.output:
            self.run(
                "echo '# systemd of the lab:'; cat /run/lab-systemd.pid; ls -l /run/systemd/private; "
                "tail -n 20 /run/lab-systemd.log; journalctl -b _PID=1 --no-pager | tail -n 20",
                title="systemctl found no bus: what the service manager says",
            )
            result = self.run(f"systemctl {args}", title=title, echo=False)
        if check and not result.ok:
            raise LabError(f"systemctl {args} failed with rc {result.rc}:\n{result.output[-2000:]}")
        return result

    def setup_salt(self, pillar_yaml=None, minion_id="lab"):
        """A masterless minion in the guest: root_dir on tmpfs, the formula as file_roots.

        Starts the guest's Salt server (lab/guest_caller.py). The formula's modules load straight
        from the checkout (``*_dirs``), so an edit needs no ``saltutil.sync_all``.
        """
        self.write("/run/salt/pillar/top.sls", "base:\n  '*':\n    - hana\n")
        self.set_pillar(pillar_yaml or self.pillar())
        self.write("/run/salt/etc/minion", MINION_CONFIG.format(repo=REPO, id=minion_id))
        spool = self.shared / "salt"
        shutil.rmtree(spool, ignore_errors=True)
        spool.mkdir()
        self._salt_step = 0
        say("starting Salt in the guest (loaded once, ~30 s under emulation)")
        self.run(
            f"setsid python3 {REPO}/lab/guest_caller.py /run/salt/etc {spool} "
            f">/run/salt/caller.out 2>&1 </dev/null &",
            check=True,
            echo=False,
        )
        started = time.monotonic()
        while not (spool / "ready").exists():
            if time.monotonic() - started > 600:
                tail = self.run("tail -n 30 /run/salt/caller.out", echo=False).output
                raise LabError(f"Salt did not start in the guest within 600 s:\n{tail}")
            time.sleep(0.3)
        self._record("salt-start", "guest_caller.py", time.monotonic() - started)
        return self.salt("test.ping", check=True, title="Salt is up in the guest")

    def set_pillar(self, pillar_yaml):
        """Replace the guest minion's pillar (hana.sls); the next call compiles it afresh."""
        self.write("/run/salt/pillar/hana.sls", pillar_yaml, mode=0o600)

    def salt(self, args, check=False, title=None, timeout=1800, detach=False, profile=None):
        """Run one `salt-call` equivalent through the guest's Salt server; returns SaltResult.

        detach: run it in a forked child of the server, in its own process group, and return at
        once with ``ret == {"pid": N}`` (for tests that kill an apply mid-way).
        profile: a host path the call's cProfile statistics (pstats) are moved to.
        """
        request = {"args": args, "detach": detach}
        if profile:  # cProfile's statistics of the call: the guest writes to the shared directory
            request["profile"] = str(self.shared / "salt" / f"profile.{self._salt_step}.pstats")
        data = self._ask_salt(request, args, title or f"salt-call {args}", timeout)
        if profile and pathlib.Path(request["profile"]).exists():
            shutil.move(request["profile"], profile)
        result = SaltResult(args, data["local"], data["retcode"], data["seconds"])
        if check and result.retcode:
            raise LabError(f"salt-call {args} failed (retcode {result.retcode}):\n{result.text()[-3000:]}")
        return result

    def detached_reply(self, pid):
        """The reply of a call made with ``detach=True`` that ended by itself (not killed), as
        ``salt`` returns it, or None."""
        reply = self.shared / "salt" / f"detached.{pid}.json"
        if not reply.exists():
            return None
        data = json.loads(reply.read_text())
        return SaltResult(f"detached {pid}", data["local"], data["retcode"], 0.0)

    def beacon_once(self, timeout=900):
        """One full audit by the formula's beacon, loaded through Salt's loader over the guest
        Salt server's modules (lab/guest_beacon.py): {"events": [...]} or {"raised": traceback}."""
        what = "the beacon's full audit"
        return self._ask_salt({"beacon": "once"}, what, f"{what} (one tick)", timeout)["local"]

    def _ask_salt(self, request, what, title, timeout):
        """Hand ``request`` to the guest's Salt server and wait for its reply."""
        spool = self.shared / "salt"
        n = self._salt_step
        self._salt_step += 1
        (spool / f"req.{n}.tmp").write_text(json.dumps(request))
        (spool / f"req.{n}.tmp").rename(spool / f"req.{n}.json")
        say(title)
        reply, started = spool / f"ret.{n}.json", time.monotonic()
        while not reply.exists():
            if self.proc.poll() is not None:
                raise LabError(f"the VM died during {what}; read {self.console}")
            if time.monotonic() - started > timeout:
                raise LabError(f"{what} took more than {timeout}s; read /run/salt/minion.log")
            time.sleep(0.1)
        self._record("salt", what[:100], time.monotonic() - started)
        return json.loads(reply.read_text())

    def salt_call(self, args, check=False, title=None, out="json", timeout=1200, echo=None):
        """A real `salt-call` process in the guest (20-30 s of start-up each); returns Result."""
        cmd = f"salt-call -c /run/salt/etc --out={out} --log-level=warning {args}"
        return self.run(cmd, check=check, title=title or f"salt-call {args}", timeout=timeout, echo=echo)

    def start_minion(self, masters, minion_id="hana-lab"):
        """A real salt-minion daemon in the guest, talking to masters on the host's loopback.

        ``masters``: one (ret_port, publish_port) per master. One master is reached at the host
        (10.0.2.2) on its own ports. More than one is Salt's hot multi-master, where a minion
        expects every master at an address of its own with the same ports (a publish port the
        master relays is not used while ``publish_port`` has its default): in the guest master i
        is 127.0.1.i on the standard ports, which socat forwards to its ports on the host.
        """
        if len(masters) == 1:
            (ret_port, publish_port), addresses = masters[0], HOST_FROM_GUEST
        else:
            ret_port, publish_port, addresses = 4506, 4505, []
            for number, ports in enumerate(masters, 1):
                address = f"127.0.1.{number}"
                for guest_port, host_port in zip((ret_port, publish_port), ports, strict=True):
                    self.run(
                        f"setsid -f socat TCP-LISTEN:{guest_port},bind={address},fork,reuseaddr "
                        f"TCP:{HOST_FROM_GUEST}:{host_port} </dev/null >/dev/null 2>&1",
                        check=True,
                        echo=False,
                    )
                addresses.append(address)
            say(f"the guest reaches {len(masters)} masters at {', '.join(addresses)} (socat to the host)")
        self.write(
            "/run/salt/etc/minion",
            DAEMON_CONFIG.format(
                id=minion_id,
                master=json.dumps(addresses),
                master_port=ret_port,
                publish_port=publish_port,
                repo=REPO,
                other_beacons=json.dumps(salts_beacons()),
            ),
        )
        self.run(
            "salt-minion -c /run/salt/etc -d",
            check=True,
            echo=False,
            title=f"starting salt-minion {minion_id}",
        )

    def minion_log(self):
        """Copy the guest minion's debug log next to the console log; returns the host path."""
        dest = self.workdir / "minion.log"
        self.run(f"cp /run/salt/minion.log {self.shared}/minion.log", echo=False)
        if (self.shared / "minion.log").exists():
            shutil.move(self.shared / "minion.log", dest)
        return dest

    def stop_salt(self):
        if (self.shared / "salt").is_dir():
            (self.shared / "salt" / "quit").touch()


class SaltResult:
    """What a salt-call returned: ``ret`` (the 'local' value), ``retcode`` and wall ``seconds``."""

    def __init__(self, args, ret, retcode, seconds):
        self.args, self.ret, self.retcode, self.seconds = args, ret, retcode, seconds

    @property
    def ok(self):
        return self.retcode == 0

    def text(self):
        return self.ret if isinstance(self.ret, str) else json.dumps(self.ret, indent=2, default=str)

    def __repr__(self):
        return f"SaltResult(retcode={self.retcode}, {self.seconds:.1f}s, {self.args[:60]!r})"


SCAP_DIRS = ("/var/lib/hana-storage", "/usr/share/xml/scap/hana-storage")

MINION_CONFIG = """id: {id}
file_client: local
root_dir: /  # the paths below are absolute: Salt prefixes them with root_dir
pki_dir: /run/salt/pki
cachedir: /run/salt/cache
sock_dir: /run/salt/sock
log_file: /run/salt/minion.log
log_level_logfile: debug
enable_fqdns_grains: false
# the host's npm, seen through the guest's PATH, would be run by Salt's npm module whenever a
# call scans every module: seconds each under emulation, for a module the formula never uses
disable_modules: [npm]
file_roots:
  base:
    - {repo}/salt
pillar_roots:
  base:
    - /run/salt/pillar
module_dirs: [{repo}/_modules]
states_dirs: [{repo}/_states]
utils_dirs: [{repo}/_utils]
beacons_dirs: [{repo}/_beacons]
"""


def salts_beacons():
    """The names of Salt's own beacon modules (the guest runs this Salt)."""
    import salt.beacons  # noqa: PLC0415 - the lab imports Salt only where it needs it

    folder = pathlib.Path(salt.beacons.__file__).parent
    return sorted(p.stem for p in folder.glob("*.py") if p.stem != "__init__")


DAEMON_CONFIG = """id: {id}
master: {master}
master_port: {master_port}
publish_port: {publish_port}
root_dir: /  # the paths below are absolute: Salt prefixes them with root_dir
pki_dir: /run/salt/pki
cachedir: /run/salt/cache
sock_dir: /run/salt/sock
pidfile: /run/salt/minion.pid
log_file: /run/salt/minion.log
log_level_logfile: debug
enable_fqdns_grains: false
acceptance_wait_time: 2
# an emulated minion beside another lab on two cores: a job's return may need more than Salt's
# 3 tries of 5-10 s to reach a busy master, and a return past its budget is dropped for good
return_retry_timer: 20
return_retry_timer_max: 40
return_retry_tries: 5
disable_modules: [npm]
# beacon.present asks the minion for its available beacons and waits 60 s for the answer, which
# loads every beacon module: over a minute under emulation (2 s on real hardware). The lab's
# minion loads the formula's beacon only.
disable_beacons: {other_beacons}
# the formula's modules straight from the checkout: `saltutil.sync_all` costs minutes under
# emulation (the integration tier proves the sync from the master's file_roots)
module_dirs: [{repo}/_modules]
states_dirs: [{repo}/_states]
utils_dirs: [{repo}/_utils]
beacons_dirs: [{repo}/_beacons]
"""


@contextlib.contextmanager
def lab(**kwargs):
    vm = Lab(**kwargs)
    try:
        yield vm.start()
    finally:
        vm.stop()
