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
// 2: the same-host offer/answer after the Hello, and the PULL and ACK frames.
// 3: Hello::nonce (a connection meant for another communicator is refused).
inline constexpr uint32_t kProtocolVersion = 3;

// Sent by each side once, right after connect/accept. The connecting side speaks first; the
// accepting side validates and answers with its own Hello (even when it is about to reject the
// connection for a rank/size mismatch, so both sides can report it).
struct Hello {
  uint64_t magic;
  uint32_t version;
  int32_t from_rank;  // the sender's rank
  int32_t to_rank;    // the rank the sender believes it is talking to
  int32_t size;       // the sender's world size
  // The accepting rank's listener nonce, which it published in the store beside its address
  // ("nonce/<rank>", see mesh.h); the accepting side echoes its own. Tells this communicator's
  // connections from those meant for another one that reached a reused port (an old epoch's
  // late connect). Also keeps the stream 16-byte aligned (see kStreamAlignment).
  uint64_t nonce;
};
static_assert(sizeof(Hello) == 32, "Hello is part of the wire format");

// Frame kinds; distinctive values so a desynchronised stream is detected at the next header.
enum class FrameKind : uint32_t {
  kData = 0x41544144,   // "DATA": `bytes` payload bytes of message `tag`
  kError = 0x21525245,  // "ERR!": the sender failed; `tag` is its absl::StatusCode, the payload
                        // its message. The sender closes the connection right after.
  // Same-host copies (see SameHostOffer): no payload on the wire.
  kPull = 0x4c4c5550,  // "PULL": message `tag` of `bytes` bytes waits at address `aux` in the
                       // sender's memory; the receiver reads it from there and answers with an
                       // ACK, only then does the send complete.
  kAck = 0x214b4341,   // "ACK!": the receiver has read the sender's oldest unacknowledged PULL
                       // (`tag` and `bytes` repeat it).
};

struct FrameHeader {
  uint32_t kind;
  uint32_t reserved0;  // 0
  uint64_t tag;
  uint64_t bytes;      // message bytes (DATA and ERROR: the payload, not counting the padding)
  uint64_t aux;        // PULL: the sender's address of the message; otherwise 0. Also keeps
                       // the header a multiple of kStreamAlignment
};
static_assert(sizeof(FrameHeader) == 32, "FrameHeader is part of the wire format");
inline constexpr size_t kHeaderBytes = sizeof(FrameHeader);

// Payload bytes that follow a header on the wire: PULL and ACK frames are the header alone.
inline constexpr uint64_t WirePayload(const FrameHeader& h) {
  return h.kind == static_cast<uint32_t>(FrameKind::kPull) ||
                 h.kind == static_cast<uint32_t>(FrameKind::kAck)
             ? 0
             : h.bytes;
}

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

// Fills `iov` (room for 3) with what remains of a frame once `done` of its
// FrameBytes(WirePayload(*header)) are written: header, payload, padding. Returns the number of
// entries used.
inline int FrameIov(const FrameHeader* header, const void* payload, size_t done, iovec* iov) {
  int n = 0;
  const size_t bytes = WirePayload(*header);
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

// Same-host negotiation, right after the Hello exchange, on every connection and in both
// directions: each side sends a SameHostOffer, reads the peer's, and, when both sides offer,
// tries to read the peer's probe word from the peer's memory with process_vm_readv; it answers
// with a SameHostAnswer saying whether the read returned the peer's nonce. A side whose peer
// could read it sends messages of at least max(both min_bytes) as PULL frames from then on; the
// other direction stays on the socket unless it succeeded too. The nonce makes a pid from
// another host or pid namespace fail the probe instead of reading a stranger's memory.
inline constexpr uint64_t kOfferMagic = 0x3176484d41534653ull;   // "FSSAMHv1"
inline constexpr uint64_t kAnswerMagic = 0x3176534e41534653ull;  // "FSSANSv1"
struct SameHostOffer {
  uint64_t magic;
  int32_t pid;        // the sender's process id (getpid())
  uint32_t willing;   // 1: same host as far as the sender can tell, and enabled
  uint64_t probe;     // address of a uint64_t holding `nonce` until the answers are in
  uint64_t nonce;
  uint64_t min_bytes;  // the sender's threshold
  uint64_t reserved;   // 0
};
static_assert(sizeof(SameHostOffer) == 48, "SameHostOffer is part of the wire format");
struct SameHostAnswer {
  uint64_t magic;
  uint32_t can_read;  // 1: the probe read returned the nonce
  uint32_t reserved;  // 0
};
static_assert(sizeof(SameHostAnswer) == 16, "SameHostAnswer is part of the wire format");

// An ERROR frame carries at most this many reason bytes; a longer one is a corrupt stream.
inline constexpr uint64_t kMaxErrorReasonBytes = 4096;

}  // namespace fairscale::comm::tcp_internal
