#!/usr/bin/env python3
"""Writes the seed corpus of tcp_transport_fuzz.cc into corpus/ (run from anywhere).

Input layout (see README.md): byte 0 flags, byte 1 op count / split / same-host threshold,
byte 2 the stream's cut point, then one byte per request, then the peer's byte stream.
"""
import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))

PULL_FROM, PULL_TO, HALF_CLOSE, CLOSE, NEGOTIATE, DRIP, RANK1, SHUTDOWN = (1 << i for i in range(8))
SIZES = [0, 1, 2, 7, 8, 15, 16, 17, 31, 32, 33, 64, 100, 255, 1024, 4096]
TAGS = [0x0000000000000107, 0x0000000100000107, 0x0000000200001101, 0x0000000300000003,
        0x000000040001020a, 0x0000000500000007, 0xffffffff00000000, 0x00000006ffffffff]
DATA, ERROR, PULL, ACK = 0x41544144, 0x21525245, 0x4c4c5550, 0x214b4341
MIN_BYTES = {1: 0, 16: 1, 64: 2, 4096: 3}
REGION = 0x5a5a00000000  # memory the harness maps for PULLs (kPullRegion)


def header(flags, ops, split=128, split_ops=False, min_bytes=16, hello=False):
    b1 = (len(ops) - 1) | (8 if split_ops else 0) | (MIN_BYTES[min_bytes] << 5) | (0x80 if hello else 0)
    return bytes([flags, b1, split]) + bytes(ops)


def op(send, size, tag=0):
    return (1 if send else 0) | (SIZES.index(size) << 1) | (tag << 5)


def frame(kind, tag, nbytes, payload=b"", aux=0, raw_tag=False):
    out = struct.pack("<IIQQQ", kind, 0, tag if raw_tag else TAGS[tag], nbytes, aux) + payload
    return out + b"\0" * ((16 - len(payload) % 16) % 16)


def error(code, reason, nbytes=None):
    """An ERROR frame: the tag is the absl::StatusCode."""
    return frame(ERROR, code, len(reason) if nbytes is None else nbytes, reason, raw_tag=True)


def data(tag, n):
    return frame(DATA, tag, n, bytes((i * 13) & 0xff for i in range(n)))


SEEDS = {
    "data_one": header(0, [op(False, 100)]) + data(0, 100),
    "data_many": header(0, [op(False, 1), op(False, 0, 1), op(True, 33, 2), op(False, 4096, 3)])
    + data(0, 1) + data(1, 0) + data(3, 4096),
    "data_split": header(HALF_CLOSE, [op(False, 17), op(False, 32, 1)], split=9, split_ops=True)
    + data(0, 17) + data(1, 32),
    "data_drip": header(DRIP, [op(False, 33), op(False, 0, 1), op(False, 2, 2)], split=2)
    + data(0, 33) + data(1, 0) + data(2, 2),
    "error_frame": header(HALF_CLOSE, [op(False, 64)])
    + error(14, b"boom"),
    "shutdown_ok": header(CLOSE | RANK1, [op(False, 8), op(False, 8, 1)])
    + data(0, 8) + error(0, b"shut down"),
    "mismatch": header(0, [op(False, 100)]) + data(1, 100),
    "truncated": header(HALF_CLOSE, [op(False, 255)]) + data(0, 255)[:100],
    "corrupt_kind": header(0, [op(False, 8)]) + frame(0x12345678, 0, 8, b"x" * 8),
    "hostile_length": header(HALF_CLOSE, [op(False, 8)])
    + frame(DATA, 1, 1 << 60) + error(14, b"", 1 << 40),
    "pull_from": header(PULL_FROM, [op(False, 100), op(False, 64, 1)])
    + frame(PULL, 0, 100, aux=0x1000) + frame(PULL, 1, 64, aux=0),
    "pull_below_min": header(PULL_FROM, [op(False, 8)], min_bytes=64) + frame(PULL, 0, 8, aux=0x1000),
    "pull_to_ack": header(PULL_TO | DRIP, [op(True, 100), op(True, 1024, 1), op(False, 8, 2)])
    + data(2, 8) + frame(ACK, 0, 100) + frame(ACK, 1, 1024),
    "read_ahead": header(PULL_TO | PULL_FROM, [op(True, 255), op(False, 7, 1), op(False, 16, 2)],
                         split_ops=True)
    + data(1, 7) + frame(PULL, 2, 16, aux=REGION + 0x10) + frame(ACK, 0, 255),
    "pull_region": header(PULL_FROM | HALF_CLOSE, [op(False, 100), op(False, 4096, 1), op(False, 8, 2)])
    + frame(PULL, 0, 100, aux=REGION) + frame(PULL, 1, 4096, aux=REGION + 60000)
    + data(2, 8),
    "parked": header(PULL_TO | HALF_CLOSE, [op(True, 4096), op(False, 1024, 1)], split_ops=True,
                     min_bytes=4096)
    + frame(DATA, 1, 2 << 20) + b"\x01" * 512,
    "wrong_ack": header(PULL_TO, [op(True, 64)], min_bytes=64) + frame(ACK, 3, 64),
    "negotiate": header(NEGOTIATE, [op(False, 32)])
    + struct.pack("<QiIQQQQ", 0x3176484d41534653, 1, 1, 0x1000, 7, 65536, 0)
    + struct.pack("<QII", 0x3176534e41534653, 0, 0) + data(0, 32),
    "negotiate_corrupt": header(NEGOTIATE | CLOSE, [op(False, 32)]) + b"GET / HTTP/1.1\r\n" * 4,
    "shutdown_after": header(SHUTDOWN | DRIP, [op(True, 4096), op(True, 1024, 1),
                                                    op(False, 2, 2)]) + data(2, 2),
    "hello_accept": header(0, [op(False, 8)], hello=True)
    + struct.pack("<QIiiiQ", 0x3130765043545346, 2, 3, 1, 4, 0) + data(0, 8),
    "hello_reply": header(0, [op(False, 8)], hello=True)
    + struct.pack("<QIiiiQ", 0x3130765043545346, 2, 0, 1, 4, 0) + data(0, 8),
    "hello_wrong": header(CLOSE, [op(False, 8)], hello=True)
    + struct.pack("<QIiiiQ", 0x3130765043545346, 1, -7, 9, 3, 0),
    "garbage": header(0xff, [0xff] * 8, split=3) + bytes(range(256)),
}

if __name__ == "__main__":
    os.makedirs(os.path.join(HERE, "corpus"), exist_ok=True)
    for name, blob in sorted(SEEDS.items()):
        with open(os.path.join(HERE, "corpus", name), "wb") as f:
            f.write(blob)
    print(f"wrote {len(SEEDS)} seeds to {os.path.join(HERE, 'corpus')}")
