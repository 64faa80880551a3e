"""Run inside the lab guest: how the guest's clocks stand against the host's. Prints one JSON line.

``python3 guest_clock.py HOST PORT``
    Exchanges UDP datagrams with the host's clock server (``lab.hana_lab.ClockServer``, reached
    through QEMU user networking) and prints ``offset`` (guest wall clock - host wall clock, in
    seconds), ``error`` (half the round trip of the exchange it was taken from: the bound on the
    offset's error) and ``realtime_minus_monotonic`` (the guest's wall clock less its monotonic
    clock, which kernel uevent stamps as ``udevadm monitor`` prints them are on).

The exchange with the shortest round trip is taken: the host read its clock within that round
trip, so the guest's midpoint is off by at most half of it. Under QEMU user networking a round
trip takes about a millisecond, against the lab's 0.2 s command poll.
"""

import json
import socket
import sys
import time

EXCHANGES = 50


def main(host, port):
    exchanges = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.settimeout(2)
        for number in range(EXCHANGES):
            sent = time.time()
            sock.sendto(str(number).encode(), (host, port))
            try:
                reply, _ = sock.recvfrom(64)
            except TimeoutError:
                continue
            received = time.time()
            answer, host_time = reply.decode().split()
            if answer == str(number):
                exchanges.append((received - sent, (sent + received) / 2 - float(host_time)))
    if not exchanges:
        sys.exit(f"no answer from the host's clock server at {host}:{port}")
    trip, offset = min(exchanges)
    pair = min(
        ((time.monotonic(), time.time(), time.monotonic()) for _ in range(20)), key=lambda p: p[2] - p[0]
    )
    print(
        json.dumps(
            {
                "offset": offset,
                "error": trip / 2,
                "exchanges": len(exchanges),
                "realtime_minus_monotonic": pair[1] - (pair[0] + pair[2]) / 2,
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
