#include "comm/bind_address.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace fairscale::comm {
namespace {

constexpr char kLoopback[] = "127.0.0.1";

std::string Errno(int err) {
  char buf[128];
  const char* text = strerror_r(err, buf, sizeof(buf));  // GNU: may return a static string
  return absl::StrCat(text, " (errno ", err, ")");
}

std::string FormatIp(const sockaddr* sa) {
  char text[INET6_ADDRSTRLEN] = "?";
  if (sa->sa_family == AF_INET) {
    inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(sa)->sin_addr, text, sizeof(text));
  } else if (sa->sa_family == AF_INET6) {
    inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6*>(sa)->sin6_addr, text,
              sizeof(text));
  }
  return text;
}

bool IsLoopback(const sockaddr* sa) {
  if (sa->sa_family == AF_INET) {
    const uint32_t a = ntohl(reinterpret_cast<const sockaddr_in*>(sa)->sin_addr.s_addr);
    return (a >> 24) == 127;
  }
  if (sa->sa_family == AF_INET6) {
    const in6_addr& a = reinterpret_cast<const sockaddr_in6*>(sa)->sin6_addr;
    if (IN6_IS_ADDR_LOOPBACK(&a)) return true;
    if (IN6_IS_ADDR_V4MAPPED(&a)) return a.s6_addr[12] == 127;
  }
  return false;
}

// getaddrinfo for a UDP "connection" to host:9 (the port only has to be non-zero).
absl::StatusOr<addrinfo*> ResolveDatagram(absl::string_view host) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* result = nullptr;
  const std::string h(host);
  const int rc = getaddrinfo(h.c_str(), "9", &hints, &result);
  if (rc != 0 || result == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot resolve '", host, "': ", rc != 0 ? gai_strerror(rc) : "no address"));
  }
  return result;
}

std::string InterfaceList() {
  std::vector<std::string> parts;
  for (const auto& [name, address] : ListInterfaces()) {
    parts.push_back(address.empty() ? absl::StrCat(name, " (no IPv4 address)")
                                    : absl::StrCat(name, " ", address));
  }
  return parts.empty() ? "none" : absl::StrJoin(parts, ", ");
}

}  // namespace

std::vector<std::pair<std::string, std::string>> ListInterfaces() {
  std::vector<std::pair<std::string, std::string>> out;
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) return out;
  for (ifaddrs* i = list; i != nullptr; i = i->ifa_next) {
    if (i->ifa_name == nullptr) continue;
    auto it = std::find_if(out.begin(), out.end(),
                           [&](const auto& e) { return e.first == i->ifa_name; });
    if (it == out.end()) {
      out.emplace_back(i->ifa_name, "");
      it = out.end() - 1;
    }
    if (it->second.empty() && i->ifa_addr != nullptr && i->ifa_addr->sa_family == AF_INET) {
      it->second = FormatIp(i->ifa_addr);
    }
  }
  freeifaddrs(list);
  return out;
}

absl::StatusOr<std::string> InterfaceIpv4Address(absl::string_view interface) {
  for (const auto& [name, address] : ListInterfaces()) {
    if (name != interface) continue;
    if (!address.empty()) return address;
    return absl::InvalidArgumentError(absl::StrCat("interface '", interface,
                                                   "' has no IPv4 address; interfaces: ",
                                                   InterfaceList()));
  }
  return absl::InvalidArgumentError(absl::StrCat("no interface named '", interface,
                                                 "' on this host; interfaces: ",
                                                 InterfaceList()));
}

absl::StatusOr<std::string> SourceAddressToward(absl::string_view host) {
  absl::StatusOr<addrinfo*> resolved = ResolveDatagram(host);
  if (!resolved.ok()) return resolved.status();
  std::string last_error = "no address";
  for (addrinfo* ai = *resolved; ai != nullptr; ai = ai->ai_next) {
    const int fd = ::socket(ai->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0) {
      last_error = absl::StrCat("socket: ", Errno(errno));
      continue;
    }
    // connect() on a UDP socket only picks the route and the source address.
    if (::connect(fd, ai->ai_addr, ai->ai_addrlen) != 0) {
      last_error = absl::StrCat("no route to ", FormatIp(ai->ai_addr), ": ", Errno(errno));
      ::close(fd);
      continue;
    }
    sockaddr_storage local{};
    socklen_t length = sizeof(local);
    const int rc = ::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &length);
    const int err = errno;
    ::close(fd);
    if (rc != 0) {
      last_error = absl::StrCat("getsockname: ", Errno(err));
      continue;
    }
    freeaddrinfo(*resolved);
    return FormatIp(reinterpret_cast<const sockaddr*>(&local));
  }
  freeaddrinfo(*resolved);
  return absl::UnavailableError(absl::StrCat("'", host, "': ", last_error));
}

bool IsLoopbackHost(absl::string_view host) {
  absl::StatusOr<addrinfo*> resolved = ResolveDatagram(host);
  if (!resolved.ok()) return false;
  bool all = true;
  for (addrinfo* ai = *resolved; ai != nullptr; ai = ai->ai_next) all &= IsLoopback(ai->ai_addr);
  freeaddrinfo(*resolved);
  return all;
}

absl::StatusOr<BindAddressChoice> ChooseBindAddress(const BindAddressInputs& in) {
  BindAddressChoice out;
  if (!in.socket_ifname.empty()) {
    absl::StatusOr<std::string> address = InterfaceIpv4Address(in.socket_ifname);
    if (!address.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("FS_SOCKET_IFNAME='", in.socket_ifname, "': ", address.status().message()));
    }
    out.address = *address;
    out.interface = in.socket_ifname;
    out.reason = absl::StrCat("FS_SOCKET_IFNAME=", in.socket_ifname);
    return out;
  }
  out.address = kLoopback;
  if (in.master_addr.empty()) {
    out.reason = "no MASTER_ADDR";
    return out;
  }
  if (in.single_node) {
    out.reason = "every rank on this host";
    return out;
  }
  if (IsLoopbackHost(in.master_addr)) {
    out.reason = absl::StrCat("MASTER_ADDR=", in.master_addr, " is loopback");
    return out;
  }
  absl::StatusOr<std::string> source = SourceAddressToward(in.master_addr);
  if (!source.ok()) {
    return absl::Status(
        source.status().code(),
        absl::StrCat("cannot choose the address this rank advertises to the others: the route to "
                     "MASTER_ADDR ",
                     source.status().message(),
                     "; set FS_SOCKET_IFNAME to the interface that reaches the other hosts "
                     "(interfaces: ",
                     InterfaceList(), ")"));
  }
  if (absl::StartsWith(*source, "127.") || *source == "::1") {
    out.reason = absl::StrCat("MASTER_ADDR=", in.master_addr, " is reached over loopback");
    return out;
  }
  out.address = *source;
  out.reason = absl::StrCat("the route to MASTER_ADDR=", in.master_addr);
  return out;
}

}  // namespace fairscale::comm
