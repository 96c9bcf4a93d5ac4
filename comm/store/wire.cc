#include "comm/store/wire.h"

#include <cstring>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "comm/store/store.h"
#include "comm/store/store_util.h"

namespace fairscale::comm::wire {
namespace {

// Value sizes beyond the raw store limits: CompareSet carries two values, Wait a list of keys.
constexpr uint64_t kMaxCompareSetValueBytes = 8 + 2 * uint64_t{kMaxStoreValueBytes};
constexpr uint64_t kMaxWaitValueBytes = kMaxStoreValueBytes;
// An emptied Decoder buffer keeps at most this much capacity.
constexpr size_t kKeepCapacityBytes = 1 << 20;

void PutU8(uint8_t v, std::string* out) { out->push_back(static_cast<char>(v)); }

void PutU32(uint32_t v, std::string* out) {
  for (int i = 0; i < 4; ++i) out->push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

void PutU64(uint64_t v, std::string* out) {
  for (int i = 0; i < 8; ++i) out->push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

uint32_t GetU32(const char* p) {
  uint32_t v = 0;
  for (int i = 3; i >= 0; --i) v = (v << 8) | static_cast<uint8_t>(p[i]);
  return v;
}

uint64_t GetU64(const char* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | static_cast<uint8_t>(p[i]);
  return v;
}

void PutHeader(WireCommand command, uint32_t id, uint32_t key_len, uint64_t value_len,
               std::string* out) {
  out->append(kWireMagic, sizeof(kWireMagic));
  PutU8(kWireVersion, out);
  PutU8(static_cast<uint8_t>(command), out);
  PutU8(0, out);
  PutU8(0, out);
  PutU32(id, out);
  PutU32(key_len, out);
  PutU64(value_len, out);
}

// Milliseconds of a timeout, clamped to [0, int64 max] (an infinite timeout is the max).
int64_t TimeoutMs(absl::Duration timeout) {
  if (timeout <= absl::ZeroDuration()) return 0;
  if (timeout == absl::InfiniteDuration()) return std::numeric_limits<int64_t>::max();
  return absl::ToInt64Milliseconds(absl::Ceil(timeout, absl::Milliseconds(1)));
}

bool IsKnownCommand(uint8_t c) {
  return (c >= static_cast<uint8_t>(WireCommand::kSet) &&
          c <= static_cast<uint8_t>(WireCommand::kHello)) ||
         (c >= static_cast<uint8_t>(WireCommand::kOk) &&
          c <= static_cast<uint8_t>(WireCommand::kError));
}

bool HasKey(WireCommand c) {
  switch (c) {
    case WireCommand::kSet:
    case WireCommand::kGet:
    case WireCommand::kAdd:
    case WireCommand::kCompareSet:
    case WireCommand::kDelete:
    case WireCommand::kCheck:
      return true;
    default:
      return false;
  }
}

// The allowed range of value_len for `c`, checked before the body is buffered.
std::pair<uint64_t, uint64_t> ValueLenRange(WireCommand c) {
  switch (c) {
    case WireCommand::kSet:
    case WireCommand::kValue:
      return {0, kMaxStoreValueBytes};
    case WireCommand::kGet:
    case WireCommand::kAdd:
    case WireCommand::kInt:
      return {8, 8};
    case WireCommand::kCompareSet:
      return {8, kMaxCompareSetValueBytes};
    case WireCommand::kDelete:
    case WireCommand::kCheck:
    case WireCommand::kOk:
      return {0, 0};
    case WireCommand::kWait:
      return {12, kMaxWaitValueBytes};
    case WireCommand::kBool:
      return {1, 1};
    case WireCommand::kError:
      return {1, 1 + kMaxErrorMessageBytes};
    case WireCommand::kHello:
      return {0, kMaxTokenBytes};
  }
  return {1, 0};  // Unknown commands never get here; an empty range rejects them anyway.
}

absl::Status Malformed(uint64_t frame_offset, absl::string_view what) {
  return absl::InvalidArgumentError(
      absl::StrCat("store wire: malformed frame at stream offset ", frame_offset, ": ", what));
}

// Checks a complete header; on success sets *command and the body length.
absl::Status CheckHeader(const char* h, Decoder::Direction direction, uint64_t frame_offset,
                         WireCommand* command, uint32_t* key_len, uint64_t* value_len) {
  if (std::memcmp(h, kWireMagic, sizeof(kWireMagic)) != 0) {
    return Malformed(frame_offset, "bad magic (not a TCPStore peer?)");
  }
  const uint8_t version = static_cast<uint8_t>(h[4]);
  if (version != kWireVersion) {
    return Malformed(frame_offset, absl::StrCat("unsupported version ", version, " (expected ",
                                                kWireVersion, ")"));
  }
  const uint8_t c = static_cast<uint8_t>(h[5]);
  if (!IsKnownCommand(c)) return Malformed(frame_offset, absl::StrCat("unknown command ", c));
  *command = static_cast<WireCommand>(c);
  const bool want_request = direction == Decoder::Direction::kRequests;
  if (IsRequest(*command) != want_request) {
    return Malformed(frame_offset, absl::StrCat(WireCommandName(c), " is not a ",
                                                want_request ? "request" : "reply"));
  }
  if (h[6] != 0 || h[7] != 0) return Malformed(frame_offset, "reserved bytes are not zero");
  *key_len = GetU32(h + 12);
  *value_len = GetU64(h + 16);
  if (HasKey(*command)) {
    if (*key_len == 0) return Malformed(frame_offset, "empty key");
    if (*key_len > kMaxStoreKeyBytes) {
      return Malformed(frame_offset, absl::StrCat("key length ", *key_len,
                                                  " exceeds the limit of ", kMaxStoreKeyBytes));
    }
  } else if (*key_len != 0) {
    return Malformed(frame_offset, absl::StrCat(WireCommandName(c), " carries a key"));
  }
  auto [lo, hi] = ValueLenRange(*command);
  if (*value_len < lo || *value_len > hi) {
    return Malformed(frame_offset, absl::StrCat(WireCommandName(c), " value length ", *value_len,
                                                " outside [", lo, ", ", hi, "]"));
  }
  return absl::OkStatus();
}

// Parses the value of a frame whose header passed CheckHeader.
absl::Status ParseBody(absl::string_view value, uint64_t frame_offset, Message* m) {
  switch (m->command) {
    case WireCommand::kSet:
    case WireCommand::kValue:
    case WireCommand::kHello:
      m->value = std::string(value);
      return absl::OkStatus();
    case WireCommand::kGet:
    case WireCommand::kAdd:
    case WireCommand::kInt:
      m->number = static_cast<int64_t>(GetU64(value.data()));
      if (m->command == WireCommand::kGet && m->number < 0) {
        return Malformed(frame_offset, "negative timeout");
      }
      return absl::OkStatus();
    case WireCommand::kCompareSet: {
      const uint64_t expected_len = GetU64(value.data());
      const uint64_t rest = value.size() - 8;
      if (expected_len > kMaxStoreValueBytes || expected_len > rest ||
          rest - expected_len > kMaxStoreValueBytes) {
        return Malformed(frame_offset, absl::StrCat("compare_set expected length ", expected_len,
                                                    " does not fit its ", rest,
                                                    " value bytes within the limit of ",
                                                    kMaxStoreValueBytes));
      }
      m->expected = std::string(value.substr(8, expected_len));
      m->value = std::string(value.substr(8 + expected_len));
      return absl::OkStatus();
    }
    case WireCommand::kDelete:
    case WireCommand::kCheck:
    case WireCommand::kOk:
      return absl::OkStatus();
    case WireCommand::kWait: {
      m->number = static_cast<int64_t>(GetU64(value.data()));
      if (m->number < 0) return Malformed(frame_offset, "negative timeout");
      const uint32_t n = GetU32(value.data() + 8);
      size_t pos = 12;
      // Every key takes at least 5 bytes, so n is bounded by the (already limited) value size
      // before the vector reserves anything.
      if (n > (value.size() - pos) / 5) {
        return Malformed(frame_offset, absl::StrCat("wait lists ", n, " keys in ",
                                                    value.size(), " bytes"));
      }
      m->keys.reserve(n);
      for (uint32_t i = 0; i < n; ++i) {
        if (value.size() - pos < 4) return Malformed(frame_offset, "wait key list truncated");
        const uint32_t len = GetU32(value.data() + pos);
        pos += 4;
        if (len == 0 || len > kMaxStoreKeyBytes || len > value.size() - pos) {
          return Malformed(frame_offset, absl::StrCat("wait key ", i, " has bad length ", len));
        }
        m->keys.emplace_back(value.substr(pos, len));
        pos += len;
      }
      if (pos != value.size()) {
        return Malformed(frame_offset, "trailing bytes after the wait key list");
      }
      return absl::OkStatus();
    }
    case WireCommand::kBool: {
      const uint8_t b = static_cast<uint8_t>(value[0]);
      if (b > 1) return Malformed(frame_offset, absl::StrCat("bool value ", b));
      m->number = b;
      return absl::OkStatus();
    }
    case WireCommand::kError: {
      const uint8_t code = static_cast<uint8_t>(value[0]);
      if (code == 0 || code > static_cast<uint8_t>(absl::StatusCode::kUnauthenticated)) {
        return Malformed(frame_offset, absl::StrCat("error reply with status code ", code));
      }
      m->number = code;
      m->value = std::string(value.substr(1));
      return absl::OkStatus();
    }
  }
  return Malformed(frame_offset, "unknown command");
}

absl::Status EncodeGetMs(uint32_t id, absl::string_view key, int64_t timeout_ms,
                         std::string* out) {
  FS_RETURN_IF_ERROR(store_internal::CheckKey(key));
  PutHeader(WireCommand::kGet, id, key.size(), 8, out);
  out->append(key.data(), key.size());
  PutU64(static_cast<uint64_t>(timeout_ms), out);
  return absl::OkStatus();
}

absl::Status EncodeWaitMs(uint32_t id, const std::vector<std::string>& keys,
                          int64_t timeout_ms, std::string* out) {
  uint64_t value_len = 12;
  for (const std::string& k : keys) {
    FS_RETURN_IF_ERROR(store_internal::CheckKey(k));
    value_len += 4 + k.size();
  }
  if (value_len > kMaxWaitValueBytes || keys.size() > std::numeric_limits<uint32_t>::max()) {
    return absl::InvalidArgumentError(absl::StrCat("store Wait on ", keys.size(), " keys needs ",
                                                   value_len, " bytes, over the limit of ",
                                                   kMaxWaitValueBytes));
  }
  PutHeader(WireCommand::kWait, id, 0, value_len, out);
  PutU64(static_cast<uint64_t>(timeout_ms), out);
  PutU32(static_cast<uint32_t>(keys.size()), out);
  for (const std::string& k : keys) {
    PutU32(k.size(), out);
    out->append(k);
  }
  return absl::OkStatus();
}

}  // namespace

std::string WireCommandName(uint8_t command) {
  switch (command) {
    case 1: return "set";
    case 2: return "get";
    case 3: return "add";
    case 4: return "compare_set";
    case 5: return "delete";
    case 6: return "check";
    case 7: return "wait";
    case 8: return "hello";
    case 64: return "ok";
    case 65: return "value";
    case 66: return "int";
    case 67: return "bool";
    case 68: return "error";
    default: return absl::StrCat("unknown(", command, ")");
  }
}

bool IsRequest(WireCommand command) { return static_cast<uint8_t>(command) < 64; }

bool operator==(const Message& a, const Message& b) {
  return a.command == b.command && a.request_id == b.request_id && a.key == b.key &&
         a.value == b.value && a.expected == b.expected && a.keys == b.keys &&
         a.number == b.number;
}

absl::Status EncodeSet(uint32_t id, absl::string_view key, absl::string_view value,
                       std::string* out) {
  FS_RETURN_IF_ERROR(store_internal::CheckKey(key));
  FS_RETURN_IF_ERROR(store_internal::CheckValue(value));
  PutHeader(WireCommand::kSet, id, key.size(), value.size(), out);
  out->append(key.data(), key.size());
  out->append(value.data(), value.size());
  return absl::OkStatus();
}

absl::Status EncodeGet(uint32_t id, absl::string_view key, absl::Duration timeout,
                       std::string* out) {
  return EncodeGetMs(id, key, TimeoutMs(timeout), out);
}

absl::Status EncodeAdd(uint32_t id, absl::string_view key, int64_t delta, std::string* out) {
  FS_RETURN_IF_ERROR(store_internal::CheckKey(key));
  PutHeader(WireCommand::kAdd, id, key.size(), 8, out);
  out->append(key.data(), key.size());
  PutU64(static_cast<uint64_t>(delta), out);
  return absl::OkStatus();
}

absl::Status EncodeCompareSet(uint32_t id, absl::string_view key, absl::string_view expected,
                              absl::string_view desired, std::string* out) {
  FS_RETURN_IF_ERROR(store_internal::CheckKey(key));
  FS_RETURN_IF_ERROR(store_internal::CheckValue(expected));
  FS_RETURN_IF_ERROR(store_internal::CheckValue(desired));
  PutHeader(WireCommand::kCompareSet, id, key.size(), 8 + expected.size() + desired.size(), out);
  out->append(key.data(), key.size());
  PutU64(expected.size(), out);
  out->append(expected.data(), expected.size());
  out->append(desired.data(), desired.size());
  return absl::OkStatus();
}

absl::Status EncodeDelete(uint32_t id, absl::string_view key, std::string* out) {
  FS_RETURN_IF_ERROR(store_internal::CheckKey(key));
  PutHeader(WireCommand::kDelete, id, key.size(), 0, out);
  out->append(key.data(), key.size());
  return absl::OkStatus();
}

absl::Status EncodeCheck(uint32_t id, absl::string_view key, std::string* out) {
  FS_RETURN_IF_ERROR(store_internal::CheckKey(key));
  PutHeader(WireCommand::kCheck, id, key.size(), 0, out);
  out->append(key.data(), key.size());
  return absl::OkStatus();
}

absl::Status EncodeWait(uint32_t id, const std::vector<std::string>& keys,
                        absl::Duration timeout, std::string* out) {
  return EncodeWaitMs(id, keys, TimeoutMs(timeout), out);
}

absl::Status EncodeHello(uint32_t id, absl::string_view token, std::string* out) {
  if (token.size() > kMaxTokenBytes) {
    return absl::InvalidArgumentError(absl::StrCat("store token of ", token.size(),
                                                   " bytes exceeds the limit of ",
                                                   kMaxTokenBytes));
  }
  PutHeader(WireCommand::kHello, id, 0, token.size(), out);
  out->append(token.data(), token.size());
  return absl::OkStatus();
}

void EncodeOk(uint32_t id, std::string* out) { PutHeader(WireCommand::kOk, id, 0, 0, out); }

void EncodeValue(uint32_t id, absl::string_view value, std::string* out) {
  PutHeader(WireCommand::kValue, id, 0, value.size(), out);
  out->append(value.data(), value.size());
}

void EncodeInt(uint32_t id, int64_t value, std::string* out) {
  PutHeader(WireCommand::kInt, id, 0, 8, out);
  PutU64(static_cast<uint64_t>(value), out);
}

void EncodeBool(uint32_t id, bool value, std::string* out) {
  PutHeader(WireCommand::kBool, id, 0, 1, out);
  PutU8(value ? 1 : 0, out);
}

void EncodeError(uint32_t id, const absl::Status& status, std::string* out) {
  absl::StatusCode code = status.ok() ? absl::StatusCode::kInternal : status.code();
  absl::string_view message = status.message().substr(0, kMaxErrorMessageBytes);
  PutHeader(WireCommand::kError, id, 0, 1 + message.size(), out);
  PutU8(static_cast<uint8_t>(code), out);
  out->append(message.data(), message.size());
}

absl::Status Encode(const Message& m, std::string* out) {
  const uint32_t id = m.request_id;
  switch (m.command) {
    case WireCommand::kSet: return EncodeSet(id, m.key, m.value, out);
    case WireCommand::kGet:
      if (m.number < 0) return absl::InvalidArgumentError("get with a negative timeout");
      return EncodeGetMs(id, m.key, m.number, out);
    case WireCommand::kAdd: return EncodeAdd(id, m.key, m.number, out);
    case WireCommand::kCompareSet: return EncodeCompareSet(id, m.key, m.expected, m.value, out);
    case WireCommand::kDelete: return EncodeDelete(id, m.key, out);
    case WireCommand::kCheck: return EncodeCheck(id, m.key, out);
    case WireCommand::kWait:
      if (m.number < 0) return absl::InvalidArgumentError("wait with a negative timeout");
      return EncodeWaitMs(id, m.keys, m.number, out);
    case WireCommand::kHello: return EncodeHello(id, m.value, out);
    case WireCommand::kOk: EncodeOk(id, out); return absl::OkStatus();
    case WireCommand::kValue:
      FS_RETURN_IF_ERROR(store_internal::CheckValue(m.value));
      EncodeValue(id, m.value, out);
      return absl::OkStatus();
    case WireCommand::kInt: EncodeInt(id, m.number, out); return absl::OkStatus();
    case WireCommand::kBool:
      if (m.number != 0 && m.number != 1) {
        return absl::InvalidArgumentError(absl::StrCat("bool reply with value ", m.number));
      }
      EncodeBool(id, m.number == 1, out);
      return absl::OkStatus();
    case WireCommand::kError:
      if (m.number <= 0 || m.number > static_cast<int>(absl::StatusCode::kUnauthenticated) ||
          m.value.size() > kMaxErrorMessageBytes) {
        return absl::InvalidArgumentError(absl::StrCat("error reply with code ", m.number,
                                                       " and ", m.value.size(),
                                                       " message bytes"));
      }
      EncodeError(id, absl::Status(static_cast<absl::StatusCode>(m.number), m.value), out);
      return absl::OkStatus();
  }
  return absl::InvalidArgumentError(
      absl::StrCat("cannot encode command ", static_cast<int>(m.command)));
}

absl::Status ErrorStatus(const Message& reply) {
  if (reply.command != WireCommand::kError) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(reply.number), reply.value);
}

absl::Status Decoder::Feed(absl::string_view bytes, std::vector<Message>* out) {
  if (!status_.ok()) return status_;
  buffer_.append(bytes.data(), bytes.size());
  DecodeBuffered(out);
  // Drop decoded frames, but move a partial frame only once it is the smaller part of the
  // buffer, so a large frame arriving in small chunks is not copied once per chunk.
  if (offset_ == buffer_.size()) {
    // A connection that once sent a 64 MiB value should not hold 64 MiB for good.
    if (buffer_.capacity() > kKeepCapacityBytes) {
      std::string().swap(buffer_);
    } else {
      buffer_.clear();
    }
    offset_ = 0;
  } else if (offset_ > 0 && offset_ >= buffer_.size() / 2) {
    buffer_.erase(0, offset_);
    offset_ = 0;
  }
  if (!status_.ok()) {
    // A broken stream is never read again: release what it holds.
    std::string().swap(buffer_);
    offset_ = 0;
  }
  return status_;
}

void Decoder::RequireHello() {
  if (consumed_ == 0 && buffer_.empty()) gate_ = Gate::kHelloOnly;
}

void Decoder::Admit() { gate_ = Gate::kOpen; }

void Decoder::DecodeBuffered(std::vector<Message>* out) {
  while (gate_ != Gate::kHeldAfterHello && buffer_.size() - offset_ >= kHeaderBytes) {
    const char* h = buffer_.data() + offset_;
    Message m;
    uint32_t key_len = 0;
    uint64_t value_len = 0;
    // Only a header whose magic matched has a request id worth quoting.
    current_request_id_ =
        std::memcmp(h, kWireMagic, sizeof(kWireMagic)) == 0 ? GetU32(h + 8) : 0;
    status_ = CheckHeader(h, direction_, consumed_, &m.command, &key_len, &value_len);
    if (status_.ok() && gate_ == Gate::kHelloOnly && m.command != WireCommand::kHello) {
      status_ = Malformed(consumed_,
                          absl::StrCat(WireCommandName(static_cast<uint8_t>(m.command)),
                                       " before the hello (the job token comes first)"));
    }
    if (!status_.ok()) {
      partial_frame_bytes_ = 0;
      return;
    }
    // Both lengths are bounded by CheckHeader, so this sum cannot overflow.
    const uint64_t frame = kHeaderBytes + key_len + value_len;
    partial_frame_bytes_ = frame;
    if (buffer_.size() - offset_ < frame) return;
    partial_frame_bytes_ = 0;
    m.request_id = GetU32(h + 8);
    m.key.assign(h + kHeaderBytes, key_len);
    status_ = ParseBody(absl::string_view(h + kHeaderBytes + key_len, value_len), consumed_, &m);
    if (!status_.ok()) return;
    offset_ += frame;
    consumed_ += frame;
    out->push_back(std::move(m));
    if (gate_ == Gate::kHelloOnly) {
      gate_ = Gate::kHeldAfterHello;
      return;
    }
  }
}

}  // namespace fairscale::comm::wire
