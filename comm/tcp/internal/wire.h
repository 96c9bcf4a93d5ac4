// Wire format of the tcp backend (internal to //comm/tcp): the handshake that opens every
// connection and the header in front of every message. Only tcp_transport and the mesh setup
// use it.
//
// Every rank of a job runs the same build on the same kind of host, so the fields travel in host
// byte order; the handshake magic doubles as the byte-order check (a peer with the other byte
// order fails it instead of desynchronising later).
#pragma once

#include <sys/uio.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>

namespace fairscale::comm::tcp_internal {

// "FSTCPv01" read as a little-endian integer.
inline constexpr uint64_t kHandshakeMagic = 0x3130765043545346ull;
inline constexpr uint32_t kProtocolVersion = 1;

// Sent by each side once, right after connect/accept. The connecting side speaks first; the
// accepting side validates and answers with its own Hello (even when it is about to reject the
// connection for a rank/size mismatch, so both sides can report it).
struct Hello {
  uint64_t magic;
  uint32_t version;
  int32_t from_rank;  // the sender's rank
  int32_t to_rank;    // the rank the sender believes it is talking to
  int32_t size;       // the sender's world size
  uint64_t reserved;  // 0; keeps the stream 16-byte aligned (see kStreamAlignment)
};
static_assert(sizeof(Hello) == 32, "Hello is part of the wire format");

// Frame kinds; distinctive values so a desynchronised stream is detected at the next header.
enum class FrameKind : uint32_t {
  kData = 0x41544144,   // "DATA": `bytes` payload bytes of message `tag`
  kError = 0x21525245,  // "ERR!": the sender failed; `tag` is its absl::StatusCode, the payload
                        // its message. The sender closes the connection right after.
};

struct FrameHeader {
  uint32_t kind;
  uint32_t reserved0;  // 0
  uint64_t tag;
  uint64_t bytes;      // payload bytes, not counting the padding after them
  uint64_t reserved1;  // 0; keeps the header a multiple of kStreamAlignment
};
static_assert(sizeof(FrameHeader) == 32, "FrameHeader is part of the wire format");
inline constexpr size_t kHeaderBytes = sizeof(FrameHeader);

// Every frame is padded with zeros to a multiple of kStreamAlignment, so each payload starts at a
// 16-byte aligned stream offset. Measured on loopback: when the kernel's copy between a user
// buffer and the socket's pages is misaligned by 8 (a 24-byte header did that), bandwidth halves.
inline constexpr size_t kStreamAlignment = 16;
inline constexpr size_t FramePad(uint64_t bytes) {
  return (kStreamAlignment - bytes % kStreamAlignment) % kStreamAlignment;
}
inline constexpr size_t FrameBytes(uint64_t bytes) {
  return kHeaderBytes + bytes + FramePad(bytes);
}
// Payload bytes of a frame already written once `done` of its FrameBytes() are.
inline constexpr size_t PayloadSent(size_t done, uint64_t bytes) {
  return done > kHeaderBytes ? std::min<size_t>(done - kHeaderBytes, bytes) : 0;
}

// Source of the padding bytes.
inline constexpr char kZeroPad[kStreamAlignment] = {};

// Fills `iov` (room for 3) with what remains of a frame once `done` of its FrameBytes() are
// written: header, payload, padding. Returns the number of entries used.
inline int FrameIov(const FrameHeader* header, const void* payload, size_t done, iovec* iov) {
  int n = 0;
  const size_t bytes = header->bytes;
  if (done < kHeaderBytes) {
    iov[n++] = {const_cast<char*>(reinterpret_cast<const char*>(header)) + done,
                kHeaderBytes - done};
  }
  const size_t sent = done > kHeaderBytes ? std::min<size_t>(done - kHeaderBytes, bytes) : 0;
  if (bytes > sent) iov[n++] = {const_cast<char*>(static_cast<const char*>(payload)) + sent,
                                bytes - sent};
  const size_t pad = FramePad(bytes);
  const size_t pad_sent = done > kHeaderBytes + bytes ? done - kHeaderBytes - bytes : 0;
  if (pad > pad_sent) iov[n++] = {const_cast<char*>(kZeroPad) + pad_sent, pad - pad_sent};
  return n;
}

// An ERROR frame carries at most this many reason bytes; a longer one is a corrupt stream.
inline constexpr uint64_t kMaxErrorReasonBytes = 4096;

}  // namespace fairscale::comm::tcp_internal
