"""The baselines and clocks the lab's encryption benchmarks share, measured in the guest."""

import json
import re

DD_RUNS = 3


def dd_in_place_seconds(vm, device, mib, mount=None):
    """Seconds for dd to copy ``mib`` MiB of ``device`` onto itself (direct I/O, 1 MiB blocks),
    each byte read and written once as a re-encryption or a pvmove does; the XFS at ``mount``
    (if any is on ``device``) frozen meanwhile, so what dd writes back is what it read."""
    freeze, thaw = (f"xfs_freeze -f {mount}", f"xfs_freeze -u {mount}") if mount else ("true", "true")
    out = vm.run(
        f"sync && {freeze} && s=$(date +%s%N) && "
        f"dd if={device} of={device} bs=1M count={mib} iflag=direct oflag=direct conv=notrunc,fsync status=none; "
        f"rc=$?; e=$(date +%s%N); {thaw}; [ $rc = 0 ] && echo $(( (e - s) / 1000000 ))",
        check=True,
        title=f"baseline: dd of {device} onto itself",
    ).output
    return int(out.split()[-1]) / 1000


def cipher_rates(vm):
    """AES-XTS (512-bit key) in memory, (encryption, decryption) in MiB/s: `cryptsetup benchmark`."""
    out = vm.run(
        "cryptsetup benchmark --cipher aes-xts-plain64 --key-size 512",
        check=True,
        title="baseline: the cipher",
    ).output
    found = re.search(r"aes-xts\s+512b\s+([\d.]+)\s+MiB/s\s+([\d.]+)\s+MiB/s", out)
    assert found, out
    return float(found.group(1)), float(found.group(2))


def _monotonic_journal(vm, unit):
    """``unit``'s journal, each line after its monotonic stamp."""
    return vm.run(
        f"journalctl --unit {unit} --output short-monotonic --no-pager", check=True, echo=False
    ).output


def unit_seconds(vm, unit):
    """How long ``unit`` ran, from its journal's first and last monotonic stamps."""
    out = _monotonic_journal(vm, unit)
    stamps = [float(s) for s in re.findall(r"^\[\s*(\d+\.\d+)\]", out, re.MULTILINE)]
    assert len(stamps) >= 2, out
    return stamps[-1] - stamps[0]


def step_seconds(vm, unit):
    """{step: seconds} of a runner that prints one JSON line per step (move_runner): each step
    from its line's monotonic stamp to the next line's, summed by the step's name."""
    out = _monotonic_journal(vm, unit)
    lines = re.findall(r"^\[\s*(\d+\.\d+)\] \S+ \S+: (\{.*\})$", out, re.MULTILINE)
    spent = {}
    for (stamp, line), (after, _) in zip(lines, lines[1:], strict=False):
        step = json.loads(line)["step"]
        spent[step] = spent.get(step, 0.0) + float(after) - float(stamp)
    return spent
