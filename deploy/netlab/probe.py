#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""What a netlab link actually carries: TCP round trip and throughput.

    probe.py serve --port P [--timeout S]
    probe.py measure --host H --port P [--bytes N] [--pings K] [--timeout S]

`serve` answers one `measure` (echoes the pings, drains the bulk data, tells
how long it took) and exits; `measure` prints one JSON line:
{"rtt_ms_median": ..., "rtt_ms_p90": ..., "bytes": N, "seconds": ...,
 "mb_per_s": ...}. Run each end in its node's namespace
(`netlab.sh exec LAB NODE -- probe.py ...`). Every wait has a deadline.
"""
import argparse
import json
import socket
import struct
import sys
import time


def recv_exact(sock, n):
    chunks = []
    while n > 0:
        chunk = sock.recv(min(n, 1 << 20))
        if not chunk:
            raise ConnectionError("peer closed the connection")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def serve(args):
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("0.0.0.0", args.port))
    listener.listen(1)
    listener.settimeout(args.timeout)
    conn, _ = listener.accept()
    conn.settimeout(args.timeout)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    pings, total = struct.unpack("!IQ", recv_exact(conn, 12))
    for _ in range(pings):
        conn.sendall(recv_exact(conn, 64))
    t0 = time.monotonic()
    left = total
    while left > 0:
        chunk = conn.recv(min(left, 1 << 20))
        if not chunk:
            raise ConnectionError("peer closed during the bulk transfer")
        left -= len(chunk)
    conn.sendall(struct.pack("!d", time.monotonic() - t0))
    conn.close()
    return 0


def measure(args):
    deadline = time.monotonic() + args.timeout
    conn = None
    while conn is None:
        try:
            conn = socket.create_connection((args.host, args.port), timeout=args.timeout)
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    conn.settimeout(args.timeout)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    conn.sendall(struct.pack("!IQ", args.pings, args.bytes))
    rtts = []
    payload = b"x" * 64
    for _ in range(args.pings):
        t0 = time.monotonic()
        conn.sendall(payload)
        recv_exact(conn, 64)
        rtts.append((time.monotonic() - t0) * 1e3)
    block = b"\0" * (1 << 20)
    left = args.bytes
    while left > 0:
        n = min(left, len(block))
        conn.sendall(block[:n])
        left -= n
    (seconds,) = struct.unpack("!d", recv_exact(conn, 8))
    conn.close()
    rtts.sort()
    result = {
        "rtt_ms_median": rtts[len(rtts) // 2] if rtts else None,
        "rtt_ms_p90": rtts[int(len(rtts) * 0.9)] if rtts else None,
        "bytes": args.bytes,
        "seconds": seconds,
        "mb_per_s": args.bytes / seconds / 1e6 if seconds > 0 else None,
    }
    print(json.dumps(result))
    return 0


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="mode", required=True)
    s = sub.add_parser("serve")
    s.add_argument("--port", type=int, required=True)
    s.add_argument("--timeout", type=float, default=60)
    m = sub.add_parser("measure")
    m.add_argument("--host", required=True)
    m.add_argument("--port", type=int, required=True)
    m.add_argument("--bytes", type=int, default=50_000_000)
    m.add_argument("--pings", type=int, default=50)
    m.add_argument("--timeout", type=float, default=60)
    args = p.parse_args()
    return serve(args) if args.mode == "serve" else measure(args)


if __name__ == "__main__":
    sys.exit(main())
