// netdelay: a fixed one-way delay for the emulated hosts (hosts.sh's mh_delay), for a kernel
// without the netem qdisc. An iptables NFQUEUE rule in a host's network namespace queues the
// host's packets to this program (running in that namespace), which gives each its ACCEPT
// verdict --delay_ms after it arrived, in arrival order (one delay for all, so FIFO is exact).
//
//   ip netns exec <ns> netdelay --queue=0 --delay_ms=20 --max_queue=1000 &
//   ip netns exec <ns> iptables -A OUTPUT -o eth0 -j NFQUEUE --queue-num 0
//
// It prints "ready" on stdout once it is bound to the queue (before that, packets sent to the
// queue are dropped: no --queue-bypass). Memory is bounded by the kernel: at most --max_queue
// packets wait for a verdict; the kernel drops the ones beyond, as a full link buffer does. The
// kernel passes metadata only (no payload) and GSO packets unsegmented, so a "packet" here may be
// a TCP segment of up to 64 KB on the sending side. On SIGTERM or SIGINT every waiting packet is
// accepted at once and it exits 0 after one line of counts on stderr.
#include <arpa/inet.h>
#include <errno.h>
#include <libnetfilter_queue/libnetfilter_queue.h>
#include <linux/netfilter.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

#include <algorithm>
#include <cstdint>
#include <deque>
#include <vector>

#include "absl/flags/flag.h"
#include "base/flags.h"

ABSL_FLAG(int, queue, 0, "the NFQUEUE number to bind (iptables --queue-num)");
ABSL_FLAG(int, delay_ms, 0, "delay each packet by this many milliseconds (>= 0)");
ABSL_FLAG(int, max_queue, 1000,
          "at most this many packets wait for their verdict; the kernel drops the rest");

namespace {

constexpr char kUsage[] =
    "netdelay --queue=N --delay_ms=MS [--max_queue=P]: delays the packets of NFQUEUE N by MS "
    "milliseconds each (run in the network namespace whose iptables rules queue to N)";

volatile sig_atomic_t g_stop = 0;
void OnSignal(int) { g_stop = 1; }

int64_t NowNs() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t{ts.tv_sec} * 1000000000 + ts.tv_nsec;
}

struct Pending {
  uint32_t id;
  int64_t release_ns;
};

struct State {
  int64_t delay_ns = 0;
  int64_t now_ns = 0;  // the receive time of the batch being parsed
  std::deque<Pending> pending;
  uint64_t delayed = 0;
  size_t peak = 0;
};

int OnPacket(nfq_q_handle*, nfgenmsg*, nfq_data* nfa, void* data) {
  auto* state = static_cast<State*>(data);
  const nfqnl_msg_packet_hdr* hdr = nfq_get_msg_packet_hdr(nfa);
  if (hdr == nullptr) return 0;
  state->pending.push_back({ntohl(hdr->packet_id), state->now_ns + state->delay_ns});
  if (state->pending.size() > state->peak) state->peak = state->pending.size();
  return 0;
}

int Fail(const char* what) {
  fprintf(stderr, "netdelay: %s: %s\n", what, strerror(errno));
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  fairscale::base::ParseCommandLine(argc, argv, kUsage);
  const int queue = absl::GetFlag(FLAGS_queue);
  const int delay_ms = absl::GetFlag(FLAGS_delay_ms);
  const int max_queue = absl::GetFlag(FLAGS_max_queue);
  if (queue < 0 || queue > 65535 || delay_ms < 0 || max_queue < 1) {
    fprintf(stderr, "netdelay: need 0 <= --queue <= 65535, --delay_ms >= 0, --max_queue >= 1\n");
    return 1;
  }

  // Signals are delivered only inside ppoll (blocked elsewhere), so no wait misses a stop.
  sigset_t blocked, during_poll;
  sigemptyset(&blocked);
  sigaddset(&blocked, SIGTERM);
  sigaddset(&blocked, SIGINT);
  sigprocmask(SIG_BLOCK, &blocked, &during_poll);
  struct sigaction sa = {};
  sa.sa_handler = OnSignal;
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGINT, &sa, nullptr);

  State state;
  state.delay_ns = int64_t{delay_ms} * 1000000;
  nfq_handle* handle = nfq_open();
  if (handle == nullptr) return Fail("nfq_open");
  nfq_q_handle* qh = nfq_create_queue(handle, queue, &OnPacket, &state);
  if (qh == nullptr) return Fail("binding the queue (is another program bound to it?)");
  if (nfq_set_mode(qh, NFQNL_COPY_META, 0) < 0) return Fail("nfq_set_mode");
  if (nfq_set_queue_maxlen(qh, max_queue) < 0) return Fail("nfq_set_queue_maxlen");
  // Whole GSO packets: one verdict per TCP send, not per MTU-sized segment. Older kernels
  // lack the flag; then the kernel segments, which is only slower.
  nfq_set_queue_flags(qh, NFQA_CFG_F_GSO, NFQA_CFG_F_GSO);
  const int fd = nfq_fd(handle);
  // Room for a full queue of notifications; a notification that does not fit is a dropped
  // packet (the kernel drops what it cannot deliver), reported as ENOBUFS below.
  const int rcvbuf = 8 << 20;
  setsockopt(fd, SOL_SOCKET, SO_RCVBUFFORCE, &rcvbuf, sizeof(rcvbuf));
  printf("ready\n");
  fflush(stdout);

  std::vector<char> buf(1 << 16);
  uint64_t overruns = 0;
  while (!g_stop) {
    timespec timeout;
    timespec* timeout_ptr = nullptr;
    if (!state.pending.empty()) {
      const int64_t wait_ns = std::max<int64_t>(0, state.pending.front().release_ns - NowNs());
      timeout = {static_cast<time_t>(wait_ns / 1000000000), static_cast<long>(wait_ns % 1000000000)};
      timeout_ptr = &timeout;
    }
    pollfd pfd = {fd, POLLIN, 0};
    const int ready = ppoll(&pfd, 1, timeout_ptr, &during_poll);
    if (ready < 0 && errno != EINTR) return Fail("ppoll");
    if (ready > 0) {
      for (;;) {
        const ssize_t n = recv(fd, buf.data(), buf.size(), MSG_DONTWAIT);
        if (n < 0) {
          if (errno == ENOBUFS) {
            ++overruns;
            continue;
          }
          if (errno == EAGAIN || errno == EINTR) break;
          return Fail("recv");
        }
        state.now_ns = NowNs();
        nfq_handle_packet(handle, buf.data(), static_cast<int>(n));
      }
    }
    const int64_t now = NowNs();
    while (!state.pending.empty() && state.pending.front().release_ns <= now) {
      nfq_set_verdict(qh, state.pending.front().id, NF_ACCEPT, 0, nullptr);
      state.pending.pop_front();
      ++state.delayed;
    }
  }
  for (const Pending& p : state.pending) nfq_set_verdict(qh, p.id, NF_ACCEPT, 0, nullptr);
  fprintf(stderr, "netdelay: queue %d: %llu packets delayed %d ms, %zu released at exit, peak %zu "
          "waiting, %llu receive overruns\n", queue, static_cast<unsigned long long>(state.delayed),
          delay_ms, state.pending.size(), state.peak, static_cast<unsigned long long>(overruns));
  nfq_destroy_queue(qh);
  nfq_close(handle);
  return 0;
}
