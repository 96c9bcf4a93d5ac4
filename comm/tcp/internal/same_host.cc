#include "comm/tcp/internal/same_host.h"

#include <netinet/in.h>
#include <poll.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "comm/tcp/internal/socket.h"
#include "comm/tcp/internal/wire.h"

namespace fairscale::comm::tcp_internal {
namespace {

// The IP part of a socket address (port dropped); empty when not IPv4/IPv6.
std::string HostPart(const sockaddr_storage& s) {
  if (s.ss_family == AF_INET) {
    const auto* in = reinterpret_cast<const sockaddr_in*>(&s);
    return std::string(reinterpret_cast<const char*>(&in->sin_addr), sizeof(in->sin_addr));
  }
  if (s.ss_family == AF_INET6) {
    const auto* in6 = reinterpret_cast<const sockaddr_in6*>(&s);
    return std::string(reinterpret_cast<const char*>(&in6->sin6_addr), sizeof(in6->sin6_addr));
  }
  return "";
}

// One fixed-size record out to and one in from every peer, concurrently.
struct Leg {
  const char* out = nullptr;
  size_t out_bytes = 0, out_done = 0;
  char* in = nullptr;
  size_t in_bytes = 0, in_done = 0;
};

absl::Status ExchangeRecords(const std::vector<MeshPeer>& mesh, int rank, std::vector<Leg>& legs,
                             absl::Time deadline, const char* what) {
  const int size = static_cast<int>(mesh.size());
  const auto error = [&](int p, absl::string_view detail) {
    return absl::UnavailableError(absl::StrCat("tcp rendezvous rank ", rank, "/", size, ": peer ",
                                               p, " (", mesh[p].address, ") ", detail,
                                               " during the same-host ", what));
  };
  std::vector<pollfd> fds;
  std::vector<int> who;
  while (true) {
    fds.clear();
    who.clear();
    for (int p = 0; p < size; ++p) {
      if (p == rank) continue;
      Leg& l = legs[p];
      const int fd = mesh[p].fd.get();
      while (l.out_done < l.out_bytes) {
        const ssize_t n = ::send(fd, l.out + l.out_done, l.out_bytes - l.out_done,
                                 MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0 && WouldBlock(errno)) break;
        if (n < 0) return error(p, absl::StrCat("failed: ", ErrnoString(errno)));
        l.out_done += n;
      }
      while (l.in_done < l.in_bytes) {
        // Exactly the record: the peer's data frames may follow right behind it.
        const ssize_t n = ::recv(fd, l.in + l.in_done, l.in_bytes - l.in_done, MSG_DONTWAIT);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0 && WouldBlock(errno)) break;
        if (n == 0) return error(p, "closed the connection");
        if (n < 0) return error(p, absl::StrCat("failed: ", ErrnoString(errno)));
        l.in_done += n;
      }
      short events = 0;
      if (l.out_done < l.out_bytes) events |= POLLOUT;
      if (l.in_done < l.in_bytes) events |= POLLIN;
      if (events != 0) {
        fds.push_back({fd, events, 0});
        who.push_back(p);
      }
    }
    if (fds.empty()) return absl::OkStatus();
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) {
      return absl::DeadlineExceededError(absl::StrCat(
          "tcp rendezvous rank ", rank, "/", size, ": timed out during the same-host ", what,
          " waiting for peer ", who.front(), " (", mesh[who.front()].address, ")"));
    }
    if (::poll(fds.data(), fds.size(), PollTimeoutMs(left)) < 0 && errno != EINTR) {
      return absl::InternalError(absl::StrCat("poll: ", ErrnoString(errno)));
    }
  }
}

}  // namespace

bool SameHostConnection(int fd) {
  sockaddr_storage local{}, remote{};
  socklen_t local_len = sizeof(local), remote_len = sizeof(remote);
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &local_len) != 0 ||
      ::getpeername(fd, reinterpret_cast<sockaddr*>(&remote), &remote_len) != 0) {
    return false;
  }
  const std::string a = HostPart(local);
  return !a.empty() && a == HostPart(remote);
}

int ReadProcessMemory(pid_t pid, uint64_t remote, void* local, size_t bytes) {
  size_t got = 0;
  while (got < bytes) {
    iovec l{static_cast<char*>(local) + got, bytes - got};
    iovec r{reinterpret_cast<void*>(remote + got), bytes - got};
    const ssize_t n = ::process_vm_readv(pid, &l, 1, &r, 1, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return errno;
    if (n == 0) return EFAULT;
    got += n;
  }
  return 0;
}

absl::StatusOr<std::vector<SameHostPeer>> NegotiateSameHost(const std::vector<MeshPeer>& mesh,
                                                            int rank, uint64_t min_bytes,
                                                            absl::Time deadline) {
  const int size = static_cast<int>(mesh.size());
  std::vector<SameHostPeer> result(size);
  if (size <= 1) return result;
  // The word peers probe; it lives on this frame until every answer is in.
  uint64_t probe = 0;
  if (::getrandom(&probe, sizeof(probe), 0) != sizeof(probe)) {
    probe = static_cast<uint64_t>(absl::GetCurrentTimeNanos()) ^ (uint64_t{1} << 63);
  }
  std::vector<SameHostOffer> offers_out(size), offers_in(size);
  std::vector<Leg> legs(size);
  for (int p = 0; p < size; ++p) {
    if (p == rank) continue;
    const bool willing = min_bytes > 0 && SameHostConnection(mesh[p].fd.get());
    offers_out[p] = SameHostOffer{kOfferMagic, static_cast<int32_t>(::getpid()),
                                  willing ? 1u : 0u, reinterpret_cast<uint64_t>(&probe),
                                  probe, min_bytes, 0};
    legs[p] = Leg{reinterpret_cast<const char*>(&offers_out[p]), sizeof(SameHostOffer), 0,
                  reinterpret_cast<char*>(&offers_in[p]), sizeof(SameHostOffer), 0};
  }
  if (absl::Status s = ExchangeRecords(mesh, rank, legs, deadline, "offer"); !s.ok()) return s;
  std::vector<SameHostAnswer> answers_out(size), answers_in(size);
  for (int p = 0; p < size; ++p) {
    if (p == rank) continue;
    const SameHostOffer& in = offers_in[p];
    if (in.magic != kOfferMagic) {
      return absl::InternalError(absl::StrCat("tcp rendezvous rank ", rank, "/", size, ": peer ",
                                              p, " (", mesh[p].address,
                                              ") sent a corrupt same-host offer"));
    }
    bool can_read = false;
    if (offers_out[p].willing == 1 && in.willing == 1 && in.min_bytes > 0) {
      uint64_t word = ~in.nonce;
      can_read = ReadProcessMemory(in.pid, in.probe, &word, sizeof(word)) == 0 &&
                 word == in.nonce;
    }
    result[p].pid = in.pid;
    result[p].pull_from = can_read;
    if (offers_out[p].willing == 1 && in.willing == 1) {
      result[p].min_bytes = std::max<uint64_t>(min_bytes, in.min_bytes);
    }
    answers_out[p] = SameHostAnswer{kAnswerMagic, can_read ? 1u : 0u, 0};
    legs[p] = Leg{reinterpret_cast<const char*>(&answers_out[p]), sizeof(SameHostAnswer), 0,
                  reinterpret_cast<char*>(&answers_in[p]), sizeof(SameHostAnswer), 0};
  }
  if (absl::Status s = ExchangeRecords(mesh, rank, legs, deadline, "answer"); !s.ok()) return s;
  for (int p = 0; p < size; ++p) {
    if (p == rank) continue;
    if (answers_in[p].magic != kAnswerMagic || answers_in[p].can_read > 1) {
      return absl::InternalError(absl::StrCat("tcp rendezvous rank ", rank, "/", size, ": peer ",
                                              p, " (", mesh[p].address,
                                              ") sent a corrupt same-host answer"));
    }
    // Only an offer we made can have been read, so can_read implies both sides were willing.
    result[p].pull_to = answers_in[p].can_read == 1 && offers_out[p].willing == 1;
    if (!result[p].pull_to && !result[p].pull_from) result[p].min_bytes = kNeverPull;
  }
  return result;
}

}  // namespace fairscale::comm::tcp_internal
