// The TCPStore wire format (//comm/store:wire): how TCPStore clients and its server frame
// requests and replies, and an incremental Decoder that turns a byte stream back into messages.
// Used by tcp_store.cc and by the decoder fuzzer (comm/store/fuzz); nothing else should need it.
//
// Every message is one frame: a fixed 24-byte header followed by `key_len` key bytes and
// `value_len` value bytes. All integers are little-endian.
//
//   offset  size  field
//        0     4  magic "FSST"
//        4     1  version (kWireVersion)
//        5     1  command (WireCommand)
//        6     2  reserved, must be 0
//        8     4  request id (the reply carries its request's id; replies may come out of order)
//       12     4  key_len
//       16     8  value_len
//
// The value layout depends on the command (see WireCommand). A client opens every connection
// with kHello carrying the job token; a server that has a token answers any other first request
// (or a wrong token) with a kUnauthenticated error and closes the connection.
// The Decoder checks the header
// against the limits of store.h before it buffers a single byte of the body, so a hostile length
// costs nothing, and it accepts only the canonical encoding: decoding a frame and encoding the
// result gives back the same bytes (the fuzzer checks this).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace fairscale::comm::wire {

inline constexpr char kWireMagic[4] = {'F', 'S', 'S', 'T'};
inline constexpr uint8_t kWireVersion = 1;
inline constexpr size_t kHeaderBytes = 24;
// Error replies carry at most this much message text (longer messages are cut when encoded).
inline constexpr size_t kMaxErrorMessageBytes = 16 << 10;
// A Hello's token is at most this long (the launcher's are 32 hex digits).
inline constexpr size_t kMaxTokenBytes = 1024;
// The largest hello frame: all an unauthenticated peer can make a gated Decoder buffer.
inline constexpr size_t kMaxHelloFrameBytes = kHeaderBytes + kMaxTokenBytes;

enum class WireCommand : uint8_t {
  // Requests (client -> server).
  kSet = 1,         // key; value = the value
  kGet = 2,         // key; value = i64 timeout in ms (>= 0): the server parks the request until
                    // the key exists and answers kDeadlineExceeded after the timeout
  kAdd = 3,         // key; value = i64 delta
  kCompareSet = 4,  // key; value = u64 expected_len, expected, desired
  kDelete = 5,      // key; empty value
  kCheck = 6,       // key; empty value
  kWait = 7,        // no key; value = i64 timeout in ms (>= 0), u32 n, n x (u32 len, key)
  kHello = 8,       // no key; value = the job token (may be empty); answered by kOk
  // Replies (server -> client).
  kOk = 64,       // empty (Set, Wait)
  kValue = 65,    // value (Get, CompareSet)
  kInt = 66,      // value = i64 (Add)
  kBool = 67,     // value = one byte, 0 or 1 (Delete, Check)
  kError = 68,    // value = u8 absl::StatusCode (not OK), message
};

// "set", "get", ... or "unknown(<n>)".
std::string WireCommandName(uint8_t command);
bool IsRequest(WireCommand command);

// One decoded frame. Which fields are meaningful depends on `command`:
//   key       Set Get Add CompareSet Delete Check
//   value     Set (the value), CompareSet (desired), Hello (token), Value reply,
//             Error (message)
//   expected  CompareSet
//   keys      Wait
//   number    Get/Wait (timeout ms), Add (delta), Int reply, Bool reply (0/1),
//             Error (the absl::StatusCode)
struct Message {
  WireCommand command = WireCommand::kOk;
  uint32_t request_id = 0;
  std::string key;
  std::string value;
  std::string expected;
  std::vector<std::string> keys;
  int64_t number = 0;

  friend bool operator==(const Message& a, const Message& b);
};

// Appends one frame to `out`. Requests return kInvalidArgument (and append nothing) when a key or
// value breaks the limits of store.h, so a client never sends a frame the server would reject.
absl::Status EncodeSet(uint32_t id, absl::string_view key, absl::string_view value,
                       std::string* out);
absl::Status EncodeGet(uint32_t id, absl::string_view key, absl::Duration timeout,
                       std::string* out);
absl::Status EncodeAdd(uint32_t id, absl::string_view key, int64_t delta, std::string* out);
absl::Status EncodeCompareSet(uint32_t id, absl::string_view key, absl::string_view expected,
                              absl::string_view desired, std::string* out);
absl::Status EncodeDelete(uint32_t id, absl::string_view key, std::string* out);
absl::Status EncodeCheck(uint32_t id, absl::string_view key, std::string* out);
absl::Status EncodeWait(uint32_t id, const std::vector<std::string>& keys,
                        absl::Duration timeout, std::string* out);
absl::Status EncodeHello(uint32_t id, absl::string_view token, std::string* out);
void EncodeOk(uint32_t id, std::string* out);
void EncodeValue(uint32_t id, absl::string_view value, std::string* out);
void EncodeInt(uint32_t id, int64_t value, std::string* out);
void EncodeBool(uint32_t id, bool value, std::string* out);
// An OK `status` is encoded as kInternal (an error reply must carry an error).
void EncodeError(uint32_t id, const absl::Status& status, std::string* out);

// Encodes any message the Decoder can produce (the inverse of decoding). kInvalidArgument when
// `message` is not encodable (limits, bad code, unknown command).
absl::Status Encode(const Message& message, std::string* out);

// The status an Error reply carries.
absl::Status ErrorStatus(const Message& error_reply);

// Incremental decoder for one direction of a connection. Feed it bytes as they arrive, in any
// chunking; it appends each complete message to `out`. It buffers at most one partial frame plus
// the bytes of the current Feed call, and it rejects a header whose lengths break the limits as
// soon as the header is complete. After an error the decoder is broken: every later Feed returns
// the same kInvalidArgument error. Not thread-safe.
class Decoder {
 public:
  enum class Direction {
    kRequests,  // a server: accepts only request commands
    kReplies,   // a client: accepts only reply commands
  };

  explicit Decoder(Direction direction) : direction_(direction) {}

  absl::Status Feed(absl::string_view bytes, std::vector<Message>* out);

  // The hello gate, for a server with a job token (call before the first Feed): until Admit(),
  // the decoder accepts one kHello and nothing else. Any other header is rejected as soon as its
  // 24 bytes are in (so an unauthenticated peer's announced length buys it nothing: at most
  // kMaxHelloFrameBytes are ever buffered for a frame), and after the hello nothing more is
  // decoded: later bytes stay buffered until the server admits the peer.
  void RequireHello();
  // Opens the gate once the hello's token was accepted; the next Feed (an empty one will do)
  // decodes the frames behind it.
  void Admit();
  // Whether the gate holds frames back (RequireHello without Admit).
  bool gated() const { return gate_ != Gate::kOpen; }

  // Bytes held that do not yet form a complete frame.
  size_t buffered() const { return buffer_.size() - offset_; }
  // Bytes of every complete frame decoded so far.
  uint64_t consumed() const { return consumed_; }
  // The full size of the frame being received, once its header is in and has passed the checks
  // (0 between frames or while the header is incomplete): what completing it will hold. A server
  // bounds this per connection and in total before reading more.
  uint64_t partial_frame_bytes() const { return partial_frame_bytes_; }
  // The request id in the last header examined (0 if none had the magic): the frame being
  // received while partial_frame_bytes() > 0, or the frame that broke the stream. A server
  // answers a refused frame under the id its client is waiting on.
  uint32_t current_request_id() const { return current_request_id_; }

 private:
  enum class Gate { kOpen, kHelloOnly, kHeldAfterHello };

  // Decodes whole frames at buffer_[offset_...]. Sets status_ on error.
  void DecodeBuffered(std::vector<Message>* out);

  const Direction direction_;
  Gate gate_ = Gate::kOpen;
  std::string buffer_;
  size_t offset_ = 0;
  uint64_t consumed_ = 0;
  uint64_t partial_frame_bytes_ = 0;
  uint32_t current_request_id_ = 0;
  absl::Status status_;
};

}  // namespace fairscale::comm::wire
