#!/usr/bin/env python3
"""Writes the seed corpus of ucx_wire_fuzz.cc into corpus/ (byte 0 picks the decoder)."""
import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))
RECEIVED, CONTROL, ADDRESS, STAT = b"\0", b"\1", b"\2", b"\3"
TAG = 0x0000000300001101  # all_reduce #3 (f32 sum)


def received(peer, expected_tag, sender_tag, expected_bytes, length):
    return RECEIVED + struct.pack("<HQQII", peer, expected_tag, sender_tag, expected_bytes, length)


SEEDS = {
    "received_match": received(1, TAG, (1 << 48) | TAG, 400, 400),
    "received_wrong_length": received(3, TAG, TAG, 400, 396),
    "received_wrong_tag": received(7, TAG, 0x0000000400000203, 8, 8),
    "received_high_bits": received(32767, 0xffff000000000107, 0x0000000000000107, 0, 0),
    "control_bye": CONTROL + struct.pack("<H", 1) + b"B",
    "control_failed": CONTROL + struct.pack("<H", 30) + b"FUNAVAILABLE: peer 2 failed: x",
    "control_empty": CONTROL + struct.pack("<H", 0),
    "control_truncated": CONTROL + struct.pack("<H", 5000) + b"F" + b"r" * 1100,
    "address_ok": ADDRESS + b"0a1b2c3d4e5f 8f6e1c7a-9b2d-4c1e-a3f0-5d6e7f809a1b 4242 1234567",
    "address_no_boot": ADDRESS + b"00ff - 1 0",
    "address_odd_hex": ADDRESS + b"abc 8f6e 4242 1",
    "address_bad_pid": ADDRESS + b"abcd 8f6e -4 1",
    "address_fields": ADDRESS + b"abcd  4242 1 extra",
    "stat_plain": STAT + b"4242 (python3) S 1 4242 4242 0 -1 4194560 1 0 0 0 0 0 0 0 20 0 1 0"
    b" 1234567 1000 10 18446744073709551615",
    "stat_tricky_name": STAT + b"4242 (a) R (b) Z 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 99",
    "stat_short": STAT + b"1 (x) S 1 2 3",
}

if __name__ == "__main__":
    os.makedirs(os.path.join(HERE, "corpus"), exist_ok=True)
    for name, blob in sorted(SEEDS.items()):
        with open(os.path.join(HERE, "corpus", name), "wb") as f:
            f.write(blob)
    print(f"wrote {len(SEEDS)} seeds to {os.path.join(HERE, 'corpus')}")
