#include "comm/store/tcp_store.h"

#include "comm/store/internal/tcp_store_parts.h"

namespace fairscale::comm {

// ---------------------------------------------------------------------------------------------

using tcp_store_internal::Client;
using tcp_store_internal::DeadlineAfter;
using tcp_store_internal::Quote;
using tcp_store_internal::QuoteAll;
using tcp_store_internal::Server;
using wire::Message;
using wire::WireCommand;

namespace {

// Get/Wait allow at least one round trip, so that a zero or tiny timeout still returns a key
// that exists. The server enforces the timeout itself; this only bounds a hung server.
constexpr absl::Duration kMinRoundTrip = absl::Milliseconds(50);

absl::Time WaitDeadline(absl::Duration timeout) {
  return std::max(DeadlineAfter(timeout), absl::Now() + kMinRoundTrip);
}

// The reply as a Status: its error, or kInternal when it is not what `expected` says.
absl::Status CheckReply(const Message& reply, WireCommand expected, const std::string& address,
                        absl::string_view what) {
  if (reply.command == WireCommand::kError) {
    const absl::Status s = wire::ErrorStatus(reply);
    return absl::Status(s.code(), absl::StrCat("TCPStore ", address, ": ", what, ": ",
                                               s.message()));
  }
  if (reply.command != expected) {
    return absl::InternalError(absl::StrCat(
        "TCPStore ", address, ": ", what, ": unexpected ",
        wire::WireCommandName(static_cast<uint8_t>(reply.command)), " reply"));
  }
  return absl::OkStatus();
}

}  // namespace

TCPStore::TCPStore(TCPStoreOptions options) : options_(std::move(options)) {}

TCPStore::~TCPStore() = default;

absl::StatusOr<std::unique_ptr<TCPStore>> TCPStore::Create(TCPStoreOptions options) {
  if (options.port < 0 || options.port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("TCPStore: port ", options.port, " is outside [0, 65535]"));
  }
  if (!options.is_server && options.port == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("TCPStore client for ", options.host, " needs the server's port, got 0"));
  }
  if (options.timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat("TCPStore: timeout must be positive, got ",
                                                   absl::FormatDuration(options.timeout)));
  }
  if (options.token.size() > wire::kMaxTokenBytes) {
    return absl::InvalidArgumentError(absl::StrCat("TCPStore: token of ", options.token.size(),
                                                   " bytes exceeds the limit of ",
                                                   wire::kMaxTokenBytes));
  }
  const TCPStoreServerLimits& limits = options.server_limits;
  if (limits.max_unauthenticated_connections < 1 ||
      limits.handshake_timeout <= absl::ZeroDuration() ||
      limits.read_timeout <= absl::ZeroDuration() || limits.max_request_bytes == 0 ||
      limits.max_buffered_bytes < limits.max_request_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "TCPStore: bad server_limits: max_unauthenticated_connections ",
        limits.max_unauthenticated_connections, " (must be >= 1), handshake_timeout ",
        absl::FormatDuration(limits.handshake_timeout), " and read_timeout ",
        absl::FormatDuration(limits.read_timeout), " (must be positive), max_request_bytes ",
        limits.max_request_bytes, " (must be positive and at most max_buffered_bytes ",
        limits.max_buffered_bytes, ")"));
  }
  if (options.wait_for_workers && (!options.is_server || options.num_workers <= 0)) {
    return absl::InvalidArgumentError(
        "TCPStore: wait_for_workers needs is_server and num_workers > 0");
  }
  std::unique_ptr<TCPStore> store(new TCPStore(options));
  std::string connect_host = options.host;
  if (options.is_server) {
    FS_ASSIGN_OR_RETURN(store->server_, Server::Start(options.host, options.port, options.token,
                                                    options.server_limits));
    store->options_.port = store->server_->port();
    // A wildcard bind address is not a destination; its own client goes over loopback.
    if (connect_host.empty() || connect_host == "0.0.0.0") connect_host = "127.0.0.1";
    if (connect_host == "::") connect_host = "::1";
    FS_VLOG(1) << "TCPStore server listening on "
                 << tcp_store_internal::HostPort(options.host, store->port());
  }
  FS_ASSIGN_OR_RETURN(store->client_,
                      Client::Connect(connect_host, store->options_.port, options.timeout,
                                      options.token));
  if (options.num_workers > 0) {
    FS_ASSIGN_OR_RETURN(int64_t joined, store->Add(kWorkersKey, 1));
    if (joined == options.num_workers) FS_RETURN_IF_ERROR(store->Set(kWorkersReadyKey, "1"));
    if (options.wait_for_workers) {
      const std::vector<std::string> ready = {std::string(kWorkersReadyKey)};
      absl::Status s = store->Wait(ready, options.timeout);
      if (absl::IsDeadlineExceeded(s)) {
        absl::StatusOr<int64_t> now = store->Add(kWorkersKey, 0);
        return absl::DeadlineExceededError(absl::StrCat(
            "TCPStore server ", store->client_->address(), ": only ", now.ok() ? *now : joined,
            " of ", options.num_workers, " workers joined within ",
            absl::FormatDuration(options.timeout)));
      }
      FS_RETURN_IF_ERROR(s);
    }
  }
  return store;
}

absl::Time TCPStore::RequestDeadline() const {
  return DeadlineAfter(options_.request_timeout > absl::ZeroDuration() ? options_.request_timeout
                                                                       : options_.timeout);
}

absl::Status TCPStore::Set(absl::string_view key, absl::string_view value) {
  FS_RETURN_IF_ERROR(store_internal::CheckKey(key));
  FS_RETURN_IF_ERROR(store_internal::CheckValue(value));
  const std::string what = absl::StrCat("set ", Quote(key));
  FS_ASSIGN_OR_RETURN(
      Message reply,
      client_->Call(
          [&](uint32_t id, std::string* out) { return wire::EncodeSet(id, key, value, out); },
          RequestDeadline(), what));
  return CheckReply(reply, WireCommand::kOk, client_->address(), what);
}

absl::StatusOr<std::string> TCPStore::Get(absl::string_view key, absl::Duration timeout) {
  FS_RETURN_IF_ERROR(store_internal::CheckKey(key));
  const std::string what = absl::StrCat("get ", Quote(key));
  absl::StatusOr<Message> reply = client_->Call(
      [&](uint32_t id, std::string* out) { return wire::EncodeGet(id, key, timeout, out); },
      WaitDeadline(timeout), what);
  if (absl::IsDeadlineExceeded(reply.status()) ||
      (reply.ok() && reply->command == WireCommand::kError &&
       reply->number == static_cast<int>(absl::StatusCode::kDeadlineExceeded))) {
    return absl::DeadlineExceededError(absl::StrCat("TCPStore ", client_->address(), ": key ",
                                                    Quote(key), " not set within ",
                                                    absl::FormatDuration(timeout)));
  }
  FS_RETURN_IF_ERROR(reply.status());
  FS_RETURN_IF_ERROR(CheckReply(*reply, WireCommand::kValue, client_->address(), what));
  return std::move(reply->value);
}

absl::StatusOr<int64_t> TCPStore::Add(absl::string_view key, int64_t delta) {
  FS_RETURN_IF_ERROR(store_internal::CheckKey(key));
  const std::string what = absl::StrCat("add ", Quote(key));
  FS_ASSIGN_OR_RETURN(
      Message reply,
      client_->Call(
          [&](uint32_t id, std::string* out) { return wire::EncodeAdd(id, key, delta, out); },
          RequestDeadline(), what));
  FS_RETURN_IF_ERROR(CheckReply(reply, WireCommand::kInt, client_->address(), what));
  return reply.number;
}

absl::StatusOr<std::string> TCPStore::CompareSet(absl::string_view key, absl::string_view expected,
                                                 absl::string_view desired) {
  FS_RETURN_IF_ERROR(store_internal::CheckKey(key));
  FS_RETURN_IF_ERROR(store_internal::CheckValue(desired));
  const std::string what = absl::StrCat("compare_set ", Quote(key));
  FS_ASSIGN_OR_RETURN(Message reply,
                      client_->Call(
                          [&](uint32_t id, std::string* out) {
                            return wire::EncodeCompareSet(id, key, expected, desired, out);
                          },
                          RequestDeadline(), what));
  FS_RETURN_IF_ERROR(CheckReply(reply, WireCommand::kValue, client_->address(), what));
  return std::move(reply.value);
}

absl::StatusOr<bool> TCPStore::Delete(absl::string_view key) {
  FS_RETURN_IF_ERROR(store_internal::CheckKey(key));
  const std::string what = absl::StrCat("delete ", Quote(key));
  FS_ASSIGN_OR_RETURN(
      Message reply,
      client_->Call([&](uint32_t id, std::string* out) { return wire::EncodeDelete(id, key, out); },
                    RequestDeadline(), what));
  FS_RETURN_IF_ERROR(CheckReply(reply, WireCommand::kBool, client_->address(), what));
  return reply.number == 1;
}

absl::Status TCPStore::Wait(absl::Span<const std::string> keys, absl::Duration timeout) {
  for (const std::string& k : keys) FS_RETURN_IF_ERROR(store_internal::CheckKey(k));
  if (keys.empty()) return absl::OkStatus();
  const std::vector<std::string> list(keys.begin(), keys.end());
  const std::string what = absl::StrCat("wait ", QuoteAll(keys));
  absl::StatusOr<Message> reply = client_->Call(
      [&](uint32_t id, std::string* out) { return wire::EncodeWait(id, list, timeout, out); },
      WaitDeadline(timeout), what);
  if (reply.ok() && reply->command == WireCommand::kError &&
      reply->number == static_cast<int>(absl::StatusCode::kDeadlineExceeded)) {
    // The server names the keys still missing.
    return absl::DeadlineExceededError(absl::StrCat("TCPStore ", client_->address(), ": ",
                                                    reply->value, " within ",
                                                    absl::FormatDuration(timeout)));
  }
  if (absl::IsDeadlineExceeded(reply.status())) {
    return absl::DeadlineExceededError(absl::StrCat("TCPStore ", client_->address(), ": keys ",
                                                    QuoteAll(keys), " not all set within ",
                                                    absl::FormatDuration(timeout)));
  }
  FS_RETURN_IF_ERROR(reply.status());
  return CheckReply(*reply, WireCommand::kOk, client_->address(), what);
}

absl::StatusOr<bool> TCPStore::Check(absl::string_view key) {
  FS_RETURN_IF_ERROR(store_internal::CheckKey(key));
  const std::string what = absl::StrCat("check ", Quote(key));
  FS_ASSIGN_OR_RETURN(
      Message reply,
      client_->Call([&](uint32_t id, std::string* out) { return wire::EncodeCheck(id, key, out); },
                    RequestDeadline(), what));
  FS_RETURN_IF_ERROR(CheckReply(reply, WireCommand::kBool, client_->address(), what));
  return reply.number == 1;
}

}  // namespace fairscale::comm
