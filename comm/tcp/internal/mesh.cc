#include "comm/tcp/internal/mesh.h"

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <memory>
#include <random>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/logging.h"
#include "comm/tcp/internal/wire.h"

namespace fairscale::comm::tcp_internal {
namespace {

constexpr absl::Duration kFirstBackoff = absl::Milliseconds(10);
constexpr absl::Duration kMaxBackoff = absl::Seconds(1);
// A rank still waiting for the others says so after kFirstReport, then every kReportEvery: a
// rank started alone (or with a wrong MASTER_ADDR / WORLD_SIZE) otherwise waits out the whole
// timeout in silence.
constexpr absl::Duration kFirstReport = absl::Seconds(5);
constexpr absl::Duration kReportEvery = absl::Seconds(30);

std::string AddressKey(int rank) { return absl::StrCat("addr/", rank); }
std::string NonceKey(int rank) { return absl::StrCat("nonce/", rank); }

uint64_t NewNonce() {
  std::random_device device;
  uint64_t nonce = 0;
  while (nonce == 0) nonce = (uint64_t{device()} << 32) ^ device();
  return nonce;
}

enum class State { kRetryWait, kConnecting, kSending, kReceiving, kDone, kDropped };

// One connection being set up. Outgoing ones go kConnecting -> kSending (our Hello) ->
// kReceiving (the reply) -> kDone and return to kRetryWait on any socket error. Incoming ones go
// kReceiving (their Hello) -> kSending (our reply) -> kDone, or kDropped.
struct Conn {
  UniqueFd fd;
  bool outgoing = false;
  int peer = -1;  // outgoing: the target; incoming: known once its Hello arrived
  std::string address;
  std::vector<SocketAddress> targets;  // outgoing: the resolved published address
  size_t next_target = 0;
  State state = State::kRetryWait;
  Hello out{};
  size_t out_done = 0;
  Hello in{};
  size_t in_done = 0;
  absl::Time retry_at = absl::InfinitePast();
  absl::Duration backoff = kFirstBackoff;
  int attempts = 0;
  std::string last_error;
  // Consecutive attempts refused or without a route, and since when (a wrong address).
  int refused = 0;
  absl::Time refused_since = absl::InfinitePast();
  // Incoming: a real peer that disagrees with us; answered first so that it reports it too.
  absl::Status fail_after_reply;
};

class MeshBuilder {
 public:
  MeshBuilder(Store& store, int rank, int size, const MeshOptions& options)
      : store_(store),
        rank_(rank),
        size_(size),
        options_(options),
        start_(absl::Now()),
        deadline_(start_ + options.timeout),
        next_report_(start_ + kFirstReport),
        peers_(size) {}

  absl::StatusOr<std::vector<MeshPeer>> Run();

 private:
  std::string Prefix() const { return absl::StrCat("tcp rendezvous rank ", rank_, "/", size_); }
  absl::Status Error(absl::StatusCode code, absl::string_view message) const {
    return absl::Status(code, absl::StrCat(Prefix(), ": ", message));
  }
  Hello MakeHello(int to_rank, uint64_t nonce) const {
    return Hello{kHandshakeMagic, kProtocolVersion, rank_, to_rank, size_, nonce};
  }
  int Connected() const {
    return static_cast<int>(std::count_if(peers_.begin(), peers_.end(),
                                          [](const MeshPeer& p) { return p.fd.valid(); }));
  }

  void StartConnect(Conn& c);
  // `err`: the errno of a failed connect, 0 for other failures.
  void Retry(Conn& c, std::string error, int err = 0);
  // kUnavailable once connects to c's published address have been refused for
  // options_.refused_timeout.
  absl::Status CheckRefused(const Conn& c, absl::Time now) const;
  absl::Status Step(Conn& c, short revents);
  absl::Status OnHello(Conn& c);
  absl::Status OnReply(Conn& c);
  absl::Status AcceptAll();
  absl::Status DeadlineError() const;
  // Logs who this rank is still waiting for, when next_report_ has passed.
  void MaybeReportWaiting();

  Store& store_;
  const int rank_;
  const int size_;
  const MeshOptions options_;
  const absl::Time start_;
  const absl::Time deadline_;
  absl::Time next_report_;
  std::vector<MeshPeer> peers_;
  std::vector<std::unique_ptr<Conn>> conns_;
  Listener listener_;
  const uint64_t nonce_ = NewNonce();  // this rank's listener's
  int strays_ = 0;
  int stale_ = 0;  // connections meant for another communicator (Hello::nonce)
};

absl::StatusOr<std::vector<MeshPeer>> MeshBuilder::Run() {
  if (size_ == 1) return std::move(peers_);
  // Ranks above us connect to us: publish where before looking up anyone else. (The last rank
  // publishes too, so every rank's address is in the store for whoever debugs a job.)
  auto listener = Listen(options_.bind_address, SOMAXCONN);
  if (!listener.ok()) return Error(listener.status().code(), listener.status().message());
  listener_ = *std::move(listener);
  // The nonce first: whoever reads the address finds it.
  if (absl::Status s = store_.Set(NonceKey(rank_), absl::StrCat(nonce_)); !s.ok()) {
    return Error(s.code(), absl::StrCat("cannot publish this rank's listener nonce in the store: ",
                                        s.message()));
  }
  if (absl::Status s = store_.Set(AddressKey(rank_), listener_.address); !s.ok()) {
    return Error(s.code(), absl::StrCat("cannot publish this rank's address in the store: ",
                                        s.message()));
  }
  if (rank_ == size_ - 1) listener_.fd.Reset();  // nobody connects to the last rank
  for (int peer = 0; peer < rank_; ++peer) {
    // In slices up to the next progress report.
    absl::StatusOr<std::string> address;
    for (;;) {
      const absl::Time now = absl::Now();
      const absl::Time until = std::min(deadline_, next_report_);
      address = store_.Get(AddressKey(peer), std::max(until - now, absl::ZeroDuration()));
      if (!absl::IsDeadlineExceeded(address.status()) || absl::Now() >= deadline_) break;
      MaybeReportWaiting();
    }
    if (!address.ok()) {
      return Error(address.status().code(),
                   absl::StrCat("rank ", peer, " did not publish its address (store key '",
                                AddressKey(peer), "'): ", address.status().message()));
    }
    auto targets = ResolveHostPort(*address);
    if (!targets.ok()) {
      return Error(absl::StatusCode::kInvalidArgument,
                   absl::StrCat("rank ", peer, " published the address '", *address,
                                "': ", targets.status().message()));
    }
    // Published before the address. (Absent only where a test forged the address: 0.)
    uint64_t nonce = 0;
    if (absl::StatusOr<bool> has = store_.Check(NonceKey(peer)); has.ok() && *has) {
      absl::StatusOr<std::string> value = store_.Get(NonceKey(peer), absl::Seconds(1));
      if (!value.ok() || !absl::SimpleAtoi(*value, &nonce)) {
        return Error(absl::StatusCode::kInternal,
                     absl::StrCat("rank ", peer, "'s listener nonce (store key '", NonceKey(peer),
                                  "') is unreadable: ",
                                  value.ok() ? *value : value.status().ToString()));
      }
    }
    auto c = std::make_unique<Conn>();
    c->outgoing = true;
    c->peer = peer;
    c->address = *address;
    c->targets = *std::move(targets);
    c->out = MakeHello(peer, nonce);
    conns_.push_back(std::move(c));
  }

  std::vector<pollfd> fds;
  std::vector<Conn*> polled;
  while (Connected() < size_ - 1) {
    absl::Time now = absl::Now();
    if (now >= deadline_) return DeadlineError();
    MaybeReportWaiting();
    absl::Time wake = std::min(deadline_, next_report_);
    for (auto& c : conns_) {
      if (c->state == State::kRetryWait) {
        if (absl::Status s = CheckRefused(*c, now); !s.ok()) return s;
        if (c->retry_at <= now) {
          StartConnect(*c);
        }
        if (c->state == State::kRetryWait) wake = std::min(wake, c->retry_at);
      }
    }
    fds.clear();
    polled.clear();
    const bool accepting = listener_.fd.valid();
    if (accepting) fds.push_back({listener_.fd.get(), POLLIN, 0});
    for (auto& c : conns_) {
      short events = 0;
      if (c->state == State::kConnecting || c->state == State::kSending) events = POLLOUT;
      if (c->state == State::kReceiving) events = POLLIN;
      if (events == 0) continue;
      fds.push_back({c->fd.get(), events, 0});
      polled.push_back(c.get());
    }
    const int64_t wait_ms = std::max<int64_t>(
        0, absl::ToInt64Milliseconds(absl::Ceil(wake - now, absl::Milliseconds(1))));
    const int n = ::poll(fds.data(), fds.size(), static_cast<int>(std::min<int64_t>(
                                                     wait_ms, 1 << 30)));
    if (n < 0 && errno != EINTR) {
      return Error(absl::StatusCode::kInternal, absl::StrCat("poll: ", ErrnoString(errno)));
    }
    if (n <= 0) continue;
    const size_t first = accepting ? 1 : 0;
    for (size_t i = 0; i < polled.size(); ++i) {
      if (fds[first + i].revents != 0) {
        if (absl::Status s = Step(*polled[i], fds[first + i].revents); !s.ok()) return s;
      }
    }
    if (accepting && (fds[0].revents & POLLIN)) {
      if (absl::Status s = AcceptAll(); !s.ok()) return s;
    }
    conns_.erase(std::remove_if(conns_.begin(), conns_.end(),
                                [](const std::unique_ptr<Conn>& c) {
                                  return c->state == State::kDone ||
                                         c->state == State::kDropped;
                                }),
                 conns_.end());
    // Every rank above us has connected: nobody else may use the listener.
    if (listener_.fd.valid()) {
      bool all_above = true;
      for (int peer = rank_ + 1; peer < size_; ++peer) all_above &= peers_[peer].fd.valid();
      if (all_above) listener_.fd.Reset();
    }
  }
  if (strays_ > 0) {
    FS_LOG(WARNING) << Prefix() << ": rejected " << strays_
                    << " connection(s) that did not speak the fairscale tcp handshake";
  }
  if (stale_ > 0) {
    FS_LOG(WARNING) << Prefix() << ": rejected " << stale_
                    << " connection(s) meant for another communicator (an earlier epoch's "
                       "late connect to a reused port?)";
  }
  return std::move(peers_);
}

void MeshBuilder::MaybeReportWaiting() {
  const absl::Time now = absl::Now();
  if (now < next_report_) return;
  next_report_ = now + kReportEvery;
  // Joined: published an address in the store (every rank does, first thing).
  std::vector<int> missing;
  for (int p = 0; p < size_; ++p) {
    absl::StatusOr<bool> has = p == rank_ ? true : store_.Check(AddressKey(p));
    if (!has.ok() || !*has) missing.push_back(p);
  }
  std::string waiting;
  if (!missing.empty()) {
    // The store's own answer for a missing key names the store ("TCPStore 127.0.0.1:29500:
    // key ... not set ..."), whatever kind it is: its part before ": key".
    absl::StatusOr<std::string> probe =
        store_.Get(AddressKey(missing.front()), absl::Milliseconds(1));
    std::string store = "?";
    if (!probe.ok()) {
      store = std::string(probe.status().message());
      store = store.substr(0, store.find(": key "));
    }
    waiting = absl::StrCat(
        "waiting for rank", missing.size() == 1 ? " " : "s ", absl::StrJoin(missing, ", "),
        " to join (", size_ - static_cast<int>(missing.size()), " of ", size_,
        " joined) in the store ", store, "; started alone, or with another MASTER_ADDR / "
        "MASTER_PORT / WORLD_SIZE than the others?");
  } else {
    std::vector<int> unconnected;
    for (int p = 0; p < size_; ++p) {
      if (p != rank_ && !peers_[p].fd.valid()) unconnected.push_back(p);
    }
    waiting = absl::StrCat("all ", size_, " ranks joined; waiting for the connection",
                           unconnected.size() == 1 ? "" : "s", " with rank",
                           unconnected.size() == 1 ? " " : "s ",
                           absl::StrJoin(unconnected, ", "));
  }
  FS_LOG(INFO) << Prefix() << ": " << waiting << " (waited "
               << absl::FormatDuration(absl::Trunc(now - start_, absl::Seconds(1)))
               << ", giving up after " << absl::FormatDuration(options_.timeout) << ")";
}

void MeshBuilder::StartConnect(Conn& c) {
  ++c.attempts;
  const SocketAddress& target = c.targets[c.next_target++ % c.targets.size()];
  c.fd.Reset(::socket(target.family(), SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (!c.fd.valid()) return Retry(c, absl::StrCat("socket: ", ErrnoString(errno)));
  if (absl::Status s = ConfigureStreamSocket(c.fd.get(), options_.send_buffer_bytes,
                                             options_.recv_buffer_bytes);
      !s.ok()) {
    return Retry(c, std::string(s.message()));
  }
  c.out_done = 0;
  c.in_done = 0;
  if (::connect(c.fd.get(), reinterpret_cast<const sockaddr*>(&target.storage), target.length) ==
      0) {
    c.state = State::kSending;
  } else if (errno == EINPROGRESS || errno == EINTR) {
    c.state = State::kConnecting;
  } else {
    const int err = errno;
    Retry(c, absl::StrCat("connect: ", ErrnoString(err)), err);
  }
}

void MeshBuilder::Retry(Conn& c, std::string error, int err) {
  c.fd.Reset();
  c.last_error = std::move(error);
  if (err == ECONNREFUSED || err == EHOSTUNREACH || err == ENETUNREACH) {
    if (c.refused++ == 0) c.refused_since = absl::Now();
  } else {
    c.refused = 0;
  }
  c.state = State::kRetryWait;
  c.retry_at = absl::Now() + c.backoff;
  c.backoff = std::min(c.backoff * 2, kMaxBackoff);
}

absl::Status MeshBuilder::Step(Conn& c, short revents) {
  const auto drop = [&](absl::string_view why) {
    FS_VLOG(1) << Prefix() << ": dropped incoming connection from " << c.address << ": " << why;
    c.state = State::kDropped;
    c.fd.Reset();
    return absl::OkStatus();
  };
  if (c.state == State::kConnecting) {
    int err = 0;
    socklen_t len = sizeof(err);
    if (::getsockopt(c.fd.get(), SOL_SOCKET, SO_ERROR, &err, &len) != 0) err = errno;
    if (err == EINPROGRESS || err == EALREADY) return absl::OkStatus();
    if (err != 0) {
      Retry(c, absl::StrCat("connect: ", ErrnoString(err)), err);
      return absl::OkStatus();
    }
    c.refused = 0;
    c.state = State::kSending;
  }
  if (c.state == State::kSending) {
    const ssize_t n = ::send(c.fd.get(), reinterpret_cast<const char*>(&c.out) + c.out_done,
                             sizeof(Hello) - c.out_done, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return absl::OkStatus();
      if (!c.outgoing) return drop(ErrnoString(errno));
      Retry(c, absl::StrCat("sending the handshake: ", ErrnoString(errno)));
      return absl::OkStatus();
    }
    c.out_done += n;
    if (c.out_done < sizeof(Hello)) return absl::OkStatus();
    if (c.outgoing) {
      c.state = State::kReceiving;
      return absl::OkStatus();  // the reply cannot be there yet
    }
    if (!c.fail_after_reply.ok()) return c.fail_after_reply;
    peers_[c.peer].fd = std::move(c.fd);
    peers_[c.peer].address = c.address;
    c.state = State::kDone;
    return absl::OkStatus();
  }
  if (c.state == State::kReceiving) {
    // Read exactly one Hello: the peer may send data frames right behind it.
    const ssize_t n = ::recv(c.fd.get(), reinterpret_cast<char*>(&c.in) + c.in_done,
                             sizeof(Hello) - c.in_done, 0);
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
      return absl::OkStatus();
    }
    if (n <= 0) {
      const std::string why = n == 0 ? "closed the connection during the handshake"
                                     : absl::StrCat("handshake failed: ", ErrnoString(errno));
      if (!c.outgoing) return drop(why);
      Retry(c, why);
      return absl::OkStatus();
    }
    c.in_done += n;
    if (c.in_done < sizeof(Hello)) return absl::OkStatus();
    return c.outgoing ? OnReply(c) : OnHello(c);
  }
  return absl::OkStatus();
}

absl::Status MeshBuilder::OnHello(Conn& c) {
  const Hello& h = c.in;
  if (h.magic != kHandshakeMagic) {
    // Not one of ours (or the other byte order): never trust it, never answer it.
    ++strays_;
    c.state = State::kDropped;
    c.fd.Reset();
    return absl::OkStatus();
  }
  if (h.version == kProtocolVersion && h.nonce != nonce_) {
    // Meant for another communicator's listener (an old epoch's late connect that reached a
    // reused port): answer, so that its side can say so, and drop it; this mesh goes on.
    ++stale_;
    FS_LOG(WARNING) << Prefix() << ": dropped a connection from " << c.address << " (rank "
                    << h.from_rank << "/" << h.size
                    << ") meant for another communicator: its listener nonce " << h.nonce
                    << " is not this one's";
    c.out = MakeHello(h.from_rank, nonce_);
    (void)::send(c.fd.get(), &c.out, sizeof(Hello), MSG_NOSIGNAL | MSG_DONTWAIT);
    c.state = State::kDropped;
    c.fd.Reset();
    return absl::OkStatus();
  }
  if (absl::Status s = CheckHello(h, rank_, size_, c.address); !s.ok()) {
    c.fail_after_reply = Error(s.code(), s.message());
  } else if (peers_[h.from_rank].fd.valid() ||
             std::any_of(conns_.begin(), conns_.end(), [&](const std::unique_ptr<Conn>& o) {
               return o.get() != &c && !o->outgoing && o->peer == h.from_rank;
             })) {
    c.fail_after_reply =
        Error(absl::StatusCode::kInvalidArgument,
              absl::StrCat("two connections claim to be rank ", h.from_rank,
                           " (the second from ", c.address, ")"));
  }
  c.peer = h.from_rank;
  c.out = MakeHello(h.from_rank, nonce_);
  c.state = State::kSending;
  // The socket is freshly connected, so our 24 bytes fit at once; Step() sends them.
  absl::Status s = Step(c, POLLOUT);
  if (!c.fail_after_reply.ok()) return c.fail_after_reply;
  return s;
}

absl::Status MeshBuilder::OnReply(Conn& c) {
  // Before the rank and size checks: the other communicator may have any size.
  if (c.in.magic == kHandshakeMagic && c.in.version == kProtocolVersion && c.out.nonce != 0 &&
      c.in.nonce != c.out.nonce) {
    return Error(absl::StatusCode::kFailedPrecondition,
                 absl::StrCat("rank ", c.peer, "'s address ", c.address,
                              " now belongs to another communicator (its listener nonce ",
                              c.in.nonce, " is not the published ", c.out.nonce,
                              "): this rank's rendezvous is stale, e.g. an earlier epoch's that "
                              "the others have left"));
  }
  if (absl::Status s = CheckReply(c.in, rank_, size_, c.peer, c.address); !s.ok()) {
    return Error(s.code(), s.message());
  }
  peers_[c.peer].fd = std::move(c.fd);
  peers_[c.peer].address = c.address;
  c.state = State::kDone;
  return absl::OkStatus();
}

absl::Status MeshBuilder::AcceptAll() {
  while (true) {
    UniqueFd fd(::accept4(listener_.fd.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC));
    if (!fd.valid()) {
      if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR || errno == ECONNABORTED) {
        return absl::OkStatus();
      }
      return Error(absl::StatusCode::kInternal,
                   absl::StrCat("accept on ", listener_.address, ": ", ErrnoString(errno)));
    }
    if (absl::Status s = ConfigureStreamSocket(fd.get(), options_.send_buffer_bytes,
                                               options_.recv_buffer_bytes);
        !s.ok()) {
      return Error(s.code(), s.message());
    }
    auto c = std::make_unique<Conn>();
    c->address = PeerAddressOf(fd.get());
    c->fd = std::move(fd);
    c->state = State::kReceiving;
    conns_.push_back(std::move(c));
  }
}

absl::Status MeshBuilder::CheckRefused(const Conn& c, absl::Time now) const {
  if (c.refused < 3 || now - c.refused_since < options_.refused_timeout) return absl::OkStatus();
  char name[256] = {};
  if (::gethostname(name, sizeof(name) - 1) != 0) name[0] = '?';
  std::string host = c.address.substr(0, c.address.rfind(':'));
  if (!host.empty() && host.front() == '[') host = host.substr(1, host.size() - 2);
  const bool loopback = absl::StartsWith(host, "127.") || host == "::1" || host == "localhost";
  std::string why;
  if (loopback) {
    why = absl::StrCat(
        "rank ", c.peer, " advertised a loopback address, which only its own host reaches, so it "
        "runs on another host than this rank (", name, "); make every rank advertise an address "
        "the other hosts reach: set FS_SOCKET_IFNAME=<interface> (e.g. eth0) for every rank, or "
        "a MASTER_ADDR that is not loopback");
  } else {
    why = absl::StrCat(
        "rank ", c.peer, " listened there when it published the address, so either this host (",
        name, ") does not reach that address or rank ", c.peer, " has exited; if it runs on "
        "another host, make every rank advertise an address the others reach: set "
        "FS_SOCKET_IFNAME=<interface> for every rank");
  }
  return Error(
      absl::StatusCode::kUnavailable,
      absl::StrCat("cannot connect to rank ", c.peer, " at ", c.address, " (", c.last_error, ", ",
                   c.refused, " attempts over ",
                   absl::FormatDuration(absl::Trunc(now - c.refused_since,
                                                    absl::Milliseconds(100))),
                   "): ", why));
}

absl::Status MeshBuilder::DeadlineError() const {
  std::vector<std::string> missing;
  for (int peer = 0; peer < size_; ++peer) {
    if (peer == rank_ || peers_[peer].fd.valid()) continue;
    if (peer > rank_) {
      missing.push_back(absl::StrCat("rank ", peer, " never completed a connection to this rank (",
                                     listener_.address, ")"));
      continue;
    }
    for (const auto& c : conns_) {
      if (!c->outgoing || c->peer != peer) continue;
      std::string what = c->last_error.empty() ? "no answer" : c->last_error;
      if (c->state == State::kReceiving) what = "no answer to the handshake";
      missing.push_back(absl::StrCat("rank ", peer, " at ", c->address, ": ", what, " (",
                                     c->attempts, " attempt", c->attempts == 1 ? "" : "s", ")"));
    }
  }
  std::string stray;
  if (strays_ > 0) {
    stray = absl::StrCat("; rejected ", strays_, " stray connection(s) without the handshake");
  }
  return Error(absl::StatusCode::kDeadlineExceeded,
               absl::StrCat("connecting the full mesh timed out after ",
                            absl::FormatDuration(options_.timeout), "; missing ",
                            absl::StrJoin(missing, "; "), stray));
}

}  // namespace

absl::Status CheckHello(const Hello& h, int rank, int size, absl::string_view address) {
  const std::string who = absl::StrCat("peer ", h.from_rank, " at ", address);
  if (h.version != kProtocolVersion) {
    return absl::InvalidArgumentError(absl::StrCat(
        who, " speaks tcp protocol version ", h.version, " but this rank speaks ",
        kProtocolVersion));
  }
  if (h.size != size) {
    return absl::InvalidArgumentError(absl::StrCat(
        who, " has world size ", h.size, " but this rank has world size ", size));
  }
  if (h.to_rank != rank || h.from_rank <= rank || h.from_rank >= size) {
    return absl::InvalidArgumentError(absl::StrCat(
        who, " believes it is connecting to rank ", h.to_rank, "; this is rank ", rank,
        ", which accepts ranks ", rank + 1, "..", size - 1,
        " (mixed-up store namespaces or stale addresses?)"));
  }
  return absl::OkStatus();
}

absl::Status CheckReply(const Hello& h, int rank, int size, int peer, absl::string_view address) {
  const std::string who = absl::StrCat("peer ", peer, " at ", address);
  if (h.magic != kHandshakeMagic) {
    return absl::InvalidArgumentError(
        absl::StrCat(who, " is not a fairscale tcp endpoint (bad handshake magic)"));
  }
  if (h.version != kProtocolVersion) {
    return absl::InvalidArgumentError(absl::StrCat(
        who, " speaks tcp protocol version ", h.version, " but this rank speaks ",
        kProtocolVersion));
  }
  if (h.size != size) {
    return absl::InvalidArgumentError(absl::StrCat(
        who, " has world size ", h.size, " but this rank has world size ", size));
  }
  if (h.from_rank != peer || h.to_rank != rank) {
    return absl::InvalidArgumentError(absl::StrCat(
        who, " answered as rank ", h.from_rank, " talking to rank ", h.to_rank,
        " (mixed-up store namespaces or stale addresses?)"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<MeshPeer>> ConnectMesh(Store& store, int rank, int size,
                                                  const MeshOptions& options) {
  if (size < 1 || rank < 0 || rank >= size) {
    return absl::InvalidArgumentError(
        absl::StrCat("tcp rendezvous: invalid rank ", rank, " for size ", size));
  }
  MeshBuilder builder(store, rank, size, options);
  return builder.Run();
}

}  // namespace fairscale::comm::tcp_internal
