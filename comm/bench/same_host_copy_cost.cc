// CPU per MB of moving bytes between two processes on one host (//comm/bench:same_host_copy_cost):
// loopback TCP (sender's send() + receiver's recv(), as the tcp backend does) against the
// receiver pulling them with process_vm_readv (cross-memory attach: one copy, nothing for the
// sender to do), with single-process memcpy as the floor. It sizes the single-copy same-host path
// the tcp backend does not have yet (fsdp/bench/README.md, "What is left"). Not a test: it prints.
//
//   ./bazelw run -c opt //comm/bench:same_host_copy_cost -- --bytes=1638400 --count=2000
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "base/flags.h"

ABSL_FLAG(int64_t, bytes, 1600 << 10, "message size (default: one GPT block's shard at 2 ranks)");
ABSL_FLAG(int, count, 2000, "messages per measurement");

namespace {

[[noreturn]] void Die(const std::string& what) {
  std::perror(("same_host_copy_cost: " + what).c_str());
  std::exit(1);
}

// This process's CPU time (user + system), seconds.
double CpuS() {
  rusage r{};
  getrusage(RUSAGE_SELF, &r);
  return r.ru_utime.tv_sec + r.ru_utime.tv_usec * 1e-6 + r.ru_stime.tv_sec +
         r.ru_stime.tv_usec * 1e-6;
}

double WallS() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

void WriteAll(int fd, const void* p, size_t n) {
  const char* c = static_cast<const char*>(p);
  while (n > 0) {
    const ssize_t r = write(fd, c, n);
    if (r <= 0) Die("write");
    c += r;
    n -= static_cast<size_t>(r);
  }
}

void ReadAll(int fd, void* p, size_t n) {
  char* c = static_cast<char*>(p);
  while (n > 0) {
    const ssize_t r = read(fd, c, n);
    if (r <= 0) Die("read");
    c += r;
    n -= static_cast<size_t>(r);
  }
}

int Main() {
  const size_t bytes = static_cast<size_t>(absl::GetFlag(FLAGS_bytes));
  const int count = absl::GetFlag(FLAGS_count);
  if (bytes == 0 || count <= 0) {
    std::fprintf(stderr, "same_host_copy_cost: --bytes and --count must be positive\n");
    return 2;
  }
  const double mb = static_cast<double>(bytes) * count / 1048576.0;
  std::vector<char> dst(bytes), src(bytes, 1);

  // Loopback TCP with the tcp backend's socket settings (TCP_NODELAY, 512 KiB SO_SNDBUF). The
  // sender reports its CPU through a pipe.
  const int listener = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof addr;
  if (listener < 0 || bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
      getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &len) != 0 ||
      listen(listener, 1) != 0) {
    Die("listen on 127.0.0.1");
  }
  int report[2], go[2];
  if (pipe(report) != 0 || pipe(go) != 0) Die("pipe");
  std::fflush(stdout);
  pid_t child = fork();
  if (child < 0) Die("fork");
  if (child == 0) {
    const int s = socket(AF_INET, SOCK_STREAM, 0);
    const int one = 1, sndbuf = 512 << 10;
    setsockopt(s, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    setsockopt(s, SOL_SOCKET, SO_SNDBUF, &sndbuf, sizeof sndbuf);
    if (connect(s, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) Die("connect");
    const double c0 = CpuS();
    for (int i = 0; i < count; ++i) {
      for (size_t done = 0; done < bytes;) {
        const ssize_t r = send(s, src.data() + done, bytes - done, 0);
        if (r <= 0) Die("send");
        done += static_cast<size_t>(r);
      }
    }
    const double cpu = CpuS() - c0;
    WriteAll(report[1], &cpu, sizeof cpu);
    _exit(0);
  }
  const int s = accept(listener, nullptr, nullptr);
  if (s < 0) Die("accept");
  double t0 = WallS(), c0 = CpuS();
  for (int i = 0; i < count; ++i) {
    for (size_t done = 0; done < bytes;) {
      const ssize_t r = recv(s, dst.data() + done, bytes - done, 0);
      if (r <= 0) Die("recv");
      done += static_cast<size_t>(r);
    }
  }
  const double recv_cpu = CpuS() - c0, tcp_wall = WallS() - t0;
  double send_cpu = 0;
  ReadAll(report[0], &send_cpu, sizeof send_cpu);
  waitpid(child, nullptr, 0);
  close(s);
  close(listener);

  // process_vm_readv: the child publishes its buffer's address and waits; we pull.
  child = fork();
  if (child < 0) Die("fork");
  if (child == 0) {
    const uintptr_t where = reinterpret_cast<uintptr_t>(src.data());
    WriteAll(report[1], &where, sizeof where);
    char x;
    ReadAll(go[0], &x, 1);
    _exit(0);
  }
  uintptr_t where = 0;
  ReadAll(report[0], &where, sizeof where);
  t0 = WallS();
  c0 = CpuS();
  for (int i = 0; i < count; ++i) {
    iovec local{dst.data(), bytes}, remote{reinterpret_cast<void*>(where), bytes};
    if (process_vm_readv(child, &local, 1, &remote, 1, 0) != static_cast<ssize_t>(bytes)) {
      Die("process_vm_readv (not permitted here? see /proc/sys/kernel/yama/ptrace_scope)");
    }
  }
  const double cma_cpu = CpuS() - c0, cma_wall = WallS() - t0;
  WriteAll(go[1], "x", 1);
  waitpid(child, nullptr, 0);

  c0 = CpuS();
  for (int i = 0; i < count; ++i) {
    std::memcpy(dst.data(), src.data(), bytes);
    __asm__ volatile("" : : "r"(dst.data()) : "memory");
  }
  const double memcpy_cpu = CpuS() - c0;

  std::printf("%zu-byte messages x %d (%.0f MB), CPU ms per MB moved:\n", bytes, count, mb);
  std::printf("  loopback TCP    %.3f (sender %.3f + receiver %.3f), %.2f GB/s\n",
              (send_cpu + recv_cpu) * 1e3 / mb, send_cpu * 1e3 / mb, recv_cpu * 1e3 / mb,
              mb * 1.048576e-3 / tcp_wall);
  std::printf("  process_vm_readv %.3f (receiver only), %.2f GB/s\n", cma_cpu * 1e3 / mb,
              mb * 1.048576e-3 / cma_wall);
  std::printf("  memcpy, one process %.3f\n", memcpy_cpu * 1e3 / mb);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  fairscale::base::ParseCommandLine(
      argc, argv,
      "CPU per MB between two processes: loopback TCP vs process_vm_readv vs memcpy.\n"
      "  same_host_copy_cost --bytes=1638400 --count=2000");
  return Main();
}
