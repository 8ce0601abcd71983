"""What a sleeping core costs the split deployment: Unix-socket round trips between two processes
on different cores, the far side working `--work-ms` before it answers, each side either
sleeping in recv or polling the socket without sleeping.

    python benchmarks/wakeup_roundtrip.py [--work-ms 0,1] [--size 4096] [--trips 300]

Prints, per setting, the round trip less the far side's work (median and mean): the cost of the
wake-ups alone.
`--spin-us` (tandem serve, both roles) is the polling variant, for cores of one's own.
"""

from __future__ import annotations

import argparse
import os
import socket
import time


def recv_exact(sock: socket.socket, n: int, poll: bool) -> bool:
    """False when the peer has closed."""
    buf = memoryview(bytearray(n))
    got = 0
    while got < n:
        try:
            k = sock.recv_into(buf[got:], 0, socket.MSG_DONTWAIT if poll else 0)
        except BlockingIOError:
            continue  # polling: try again at once
        if k == 0:
            return False
        got += k
    return True


def far_side(sock: socket.socket, size: int, work_s: float, poll: bool) -> None:
    while recv_exact(sock, size, poll):
        start = time.perf_counter()
        while time.perf_counter() - start < work_s:  # busy: the experts computing
            pass
        sock.sendall(bytes(size))


def measure(size: int, trips: int, work_ms: float, poll: bool, cores: tuple[int, int]) -> tuple[float, float]:
    """(median, mean) round trip less the work, in microseconds: a few slow wake-ups move the mean."""
    near, far = socket.socketpair()
    pid = os.fork()
    if pid == 0:  # the far side: answers until the near side closes
        near.close()
        os.sched_setaffinity(0, {cores[1]})
        far_side(far, size, work_ms / 1e3, poll)
        os._exit(0)
    far.close()
    os.sched_setaffinity(0, {cores[0]})
    message, trips_s = bytes(size), []
    for _ in range(trips):
        start = time.perf_counter()
        near.sendall(message)
        recv_exact(near, size, poll)
        trips_s.append(time.perf_counter() - start)
    near.close()
    os.waitpid(pid, 0)
    trips_s.sort()
    median, mean = trips_s[len(trips_s) // 2], sum(trips_s) / len(trips_s)
    return (median - work_ms / 1e3) * 1e6, (mean - work_ms / 1e3) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work-ms", default="0,1", help="comma-separated: the far side's work per request")
    ap.add_argument("--size", type=int, default=4096, help="bytes each way (one token's hidden state: 4 KB)")
    ap.add_argument("--trips", type=int, default=300)
    args = ap.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit("needs 2 cores")
    print(f"load average {os.getloadavg()[0]:.2f}; near side on core {cores[0]}, far side on core {cores[1]}")
    for work_ms in (float(w) for w in args.work_ms.split(",")):
        for poll in (False, True):
            median, mean = measure(args.size, args.trips, work_ms, poll, (cores[0], cores[1]))
            print(f"work {work_ms:g} ms, {'polling' if poll else 'sleeping'}: round trip = work + {median:.0f} us "
                  f"(median), + {mean:.0f} us (mean)")


if __name__ == "__main__":
    main()
