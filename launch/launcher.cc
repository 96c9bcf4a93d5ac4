#include "launch/launcher.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <utility>

#include "absl/random/random.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "base/status_macros.h"
#include "base/subprocess.h"
#include "comm/store/tcp_store.h"
#include "launch/line_prefixer.h"
#include "launch/replica_groups.h"

namespace fairscale::launch {
namespace {

// How often the monitor loop wakes up without events, and how often a multi-node launcher looks
// for another node's failure in the store.
constexpr int kPollMs = 50;
constexpr absl::Duration kStoreCheckPeriod = absl::Milliseconds(250);
// After the last rank exits, how long to wait for the end of its output (a grandchild that
// inherited the pipe may keep it open).
constexpr absl::Duration kOutputDrain = absl::Seconds(1);
// Each store request of a multi-node launcher (other than the rendezvous' waits): the store is
// another host's, and a launcher blocked on an unreachable one supervises nothing. A request
// that times out is retried later (those that must arrive are idempotent) and an unreachable
// store fails the job only after rendezvous_timeout; meanwhile the ranks' own operation
// timeouts notice unreachable peers.
constexpr absl::Duration kStoreRequestTimeout = absl::Seconds(2);
// After the job ended, how long node 0 keeps the store up for the other launchers to read the
// outcome, beyond stopping their ranks (stop_timeout) and draining their output.
constexpr absl::Duration kFinishGrace = absl::Seconds(2);

// ---------------------------------------------------------------------------------------------
// SIGINT / SIGTERM / SIGHUP / SIGQUIT arrive through a self-pipe, so the monitor loop's poll() sees
// them.

int g_signal_write_fd = -1;

void OnSignal(int sig) {
  const int saved = errno;
  const unsigned char b = static_cast<unsigned char>(sig);
  (void)!write(g_signal_write_fd, &b, 1);
  errno = saved;
}

class SignalPipe {
 public:
  static absl::StatusOr<std::unique_ptr<SignalPipe>> Install() {
    int fds[2];
    if (pipe2(fds, O_CLOEXEC | O_NONBLOCK) != 0) {
      return absl::InternalError(absl::StrCat("fs_launch: pipe2: ", std::strerror(errno)));
    }
    std::unique_ptr<SignalPipe> p(new SignalPipe(fds[0], fds[1]));
    g_signal_write_fd = fds[1];
    struct sigaction sa;
    std::memset(&sa, 0, sizeof(sa));
    sa.sa_handler = &OnSignal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, &p->old_int_);
    sigaction(SIGTERM, &sa, &p->old_term_);
    // The ranks have process groups of their own, so a closed terminal (SIGHUP) or Ctrl-backslash
    // (SIGQUIT) reaches only the launcher: it forwards them too rather than orphan the ranks.
    sigaction(SIGHUP, &sa, &p->old_hup_);
    sigaction(SIGQUIT, &sa, &p->old_quit_);
    // A closed stdout must not kill the launcher (and orphan the ranks): writes fail instead.
    std::memset(&sa, 0, sizeof(sa));
    sa.sa_handler = SIG_IGN;
    sigaction(SIGPIPE, &sa, &p->old_pipe_);
    return p;
  }

  ~SignalPipe() {
    sigaction(SIGINT, &old_int_, nullptr);
    sigaction(SIGTERM, &old_term_, nullptr);
    sigaction(SIGHUP, &old_hup_, nullptr);
    sigaction(SIGQUIT, &old_quit_, nullptr);
    sigaction(SIGPIPE, &old_pipe_, nullptr);
    g_signal_write_fd = -1;
    close(read_fd_);
    close(write_fd_);
  }

  int read_fd() const { return read_fd_; }

  // The last signal received since the previous call; 0 if none.
  int Take() {
    unsigned char buf[64];
    int last = 0;
    while (true) {
      const ssize_t n = read(read_fd_, buf, sizeof(buf));
      if (n > 0) {
        last = buf[n - 1];
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      return last;
    }
  }

 private:
  SignalPipe(int r, int w) : read_fd_(r), write_fd_(w) {}
  const int read_fd_;
  const int write_fd_;
  struct sigaction old_int_;
  struct sigaction old_term_;
  struct sigaction old_hup_;
  struct sigaction old_quit_;
  struct sigaction old_pipe_;
};

// Writes all of `s`; gives up on a descriptor that stays full for a while or is closed (the
// ranks must keep running even if nobody reads the launcher's output).
void WriteAll(int fd, absl::string_view s) {
  while (!s.empty()) {
    const ssize_t n = write(fd, s.data(), s.size());
    if (n > 0) {
      s.remove_prefix(static_cast<size_t>(n));
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      pollfd p{fd, POLLOUT, 0};
      if (poll(&p, 1, 1000) > 0) continue;
    }
    return;
  }
}

std::string SignalName(int sig) {
  const char* abbrev = sigabbrev_np(sig);
  return abbrev != nullptr ? absl::StrCat("SIG", abbrev) : absl::StrCat("signal ", sig);
}

// How a rank ended, for messages, and its status as the launcher reports it.
struct Ending {
  int status = 0;  // exit code, or 128 + signal
  std::string what;
};

Ending FromWaitStatus(int wstatus) {
  if (WIFSIGNALED(wstatus)) {
    const int sig = WTERMSIG(wstatus);
    return {128 + sig,
            absl::StrCat("was killed by ", SignalName(sig), " (status ", 128 + sig, ")")};
  }
  const int code = WEXITSTATUS(wstatus);
  return {code, absl::StrCat("exited with code ", code)};
}

struct Rank {
  int rank = 0;
  int local_rank = 0;
  pid_t pid = -1;
  bool running = false;
  // Set while the rank is stopped (WIFSTOPPED): since when, and by which signal.
  absl::Time stopped_since = absl::InfiniteFuture();
  int stop_signal = 0;
  // This incarnation exited 0 (its group is then not restarted: its work is done).
  bool exited_zero = false;
  int out_fd = -1;
  int err_fd = -1;
  std::unique_ptr<LinePrefixer> out;
  std::unique_ptr<LinePrefixer> err;
};

// A failure of the job: which rank (-1 when unknown), its status and a description.
struct Failure {
  int rank = -1;
  int status = 1;
  std::string what;  // "rank 3 exited with code 7"
};

struct Outcome {
  int status = 0;
  std::optional<Failure> failure;  // set when a rank failed (here or on another node)
  int launcher_signal = 0;         // set when the launcher was told to stop
};

// "<rank> <status> <description>" in the store's failure key.
std::string EncodeFailure(const Failure& f) {
  return absl::StrCat(f.rank, " ", f.status, " ", f.what);
}

Failure DecodeFailure(absl::string_view v) {
  Failure f;
  f.what = std::string(v);
  const size_t a = v.find(' ');
  if (a == absl::string_view::npos) return f;
  const size_t b = v.find(' ', a + 1);
  if (b == absl::string_view::npos) return f;
  int rank = 0;
  int status = 0;
  if (absl::SimpleAtoi(v.substr(0, a), &rank) &&
      absl::SimpleAtoi(v.substr(a + 1, b - a - 1), &status)) {
    f.rank = rank;
    f.status = status;
    f.what = std::string(v.substr(b + 1));
  }
  return f;
}

class Job {
 public:
  Job(const LaunchOptions& o, comm::Store& store, int master_port, std::string token,
      SignalPipe& signals)
      : o_(o),
        store_(store),
        master_port_(master_port),
        token_(std::move(token)),
        signals_(signals),
        groups_(o) {}

  void Say(absl::string_view message) {
    WriteAll(o_.stderr_fd, absl::StrCat("fs_launch: ", message, "\n"));
  }

  absl::StatusOr<Outcome> RunAttempt(int attempt);
  // Node 0 keeps the store up until every launcher has read the end of the job.
  absl::Status FinishJob(int attempt);

 private:
  std::string Key(int attempt, absl::string_view name) const {
    return absl::StrCat("fs_launch/", attempt, "/", name);
  }
  // Meets the other launchers before attempt `attempt`; a signal ends the wait.
  absl::StatusOr<int> Rendezvous(int attempt);
  absl::Status SpawnRanks(int attempt);
  // Starts (again) the rank of local rank `local`, whose previous incarnation was reaped.
  absl::Status SpawnRank(int local, int attempt);
  // On a rank that could not be started: kills the others, tells the other nodes, returns `s`.
  absl::Status SpawnFailed(absl::Status s, const std::string& failed_key);
  void SignalRanks(int sig);
  // Signals the rank's process group, then continues it (a stopped process acts on a signal
  // other than SIGKILL only once continued).
  void SignalRank(const Rank& r, int sig);
  void KillAndReapAll();
  // Collects a state change of the running rank `r` (waitpid WNOHANG): how it ended, when it
  // exited or has been stopped past stopped_timeout (a failure like a kill by that signal);
  // nothing when it runs on or was only stopped or continued (reported, unless `quiet`: the
  // launcher is stopping it).
  std::optional<Ending> Reap(Rank& r, bool quiet);
  // Replica groups: after rank `failed` ended with `e`, starts stopping its group for a restart
  // and returns true; or returns false and sets `why` to why the group is not restarted (the
  // job fails).
  bool BeginGroupRestart(const Rank& failed, const Ending& e, std::string& why);
  // Replica groups being restarted: SIGKILL for ranks past the stop timeout; once all of a
  // group's ranks are reaped, starts them again.
  absl::Status AdvanceGroupRestarts(int attempt);
  bool GroupRestarting(const Rank& r) const {
    return groups_.enabled() && groups_.restarting(groups_.GroupOf(r.rank));
  }
  // Reads what is available on `fd` into `prefixer`; closes it at EOF.
  void Pump(int& fd, LinePrefixer& prefixer);
  // Reads what is left of a rank's output and closes its pipes.
  void CloseOutput(Rank& r);
  void CloseOutputs();
  // Waits until every node's ranks finished, or another node failed.
  absl::StatusOr<Outcome> AwaitOtherNodes(int attempt);

  const LaunchOptions& o_;
  comm::Store& store_;
  const int master_port_;
  const std::string token_;
  SignalPipe& signals_;
  std::vector<Rank> ranks_;
  ReplicaGroups groups_;
};

absl::StatusOr<int> Job::Rendezvous(int attempt) {
  // One key per node (Set is idempotent: a request that timed out on an unreachable store and
  // arrives later, or its retry, changes nothing), all awaited by every node.
  std::vector<std::string> joined;
  for (int n = 0; n < o_.nnodes; ++n) joined.push_back(Key(attempt, absl::StrCat("joined/", n)));
  const absl::Time deadline = absl::Now() + o_.rendezvous_timeout;
  bool set = false;
  absl::Status last;
  while (true) {
    if (!set) {
      last = store_.Set(joined[o_.node_rank], "1");
      if (!last.ok() && !absl::IsDeadlineExceeded(last)) return last;
      set = last.ok();
    }
    if (set) {
      last = store_.Wait(joined, absl::Milliseconds(200));
      if (last.ok()) return 0;
      if (!absl::IsDeadlineExceeded(last)) return last;
    }
    if (const int sig = signals_.Take(); sig != 0) return sig;
    if (absl::Now() >= deadline) {
      int now = 0;
      for (const std::string& k : joined) {
        absl::StatusOr<bool> in = store_.Check(k);
        now += in.ok() && *in ? 1 : 0;
      }
      return absl::DeadlineExceededError(
          absl::StrCat("fs_launch: node ", o_.node_rank, ": only ", now,
                       " of ", o_.nnodes, " launchers joined attempt ", attempt, " within ",
                       absl::FormatDuration(o_.rendezvous_timeout),
                       " (start one fs_launch per node with the same --nnodes, --master_addr, "
                       "--master_port and FS_STORE_TOKEN)",
                       set ? "" : absl::StrCat("; this node could not reach the store: ",
                                               last.message())));
    }
  }
}

absl::Status Job::SpawnRanks(int attempt) {
  ranks_.clear();
  ranks_.resize(o_.nproc_per_node);
  for (int local = 0; local < o_.nproc_per_node; ++local) {
    FS_RETURN_IF_ERROR(SpawnRank(local, attempt));
  }
  return absl::OkStatus();
}

absl::Status Job::SpawnRank(int local, int attempt) {
  Rank& r = ranks_[local];
  CloseOutput(r);
  r = Rank();
  r.local_rank = local;
  r.rank = o_.node_rank * o_.nproc_per_node + local;
  const std::vector<std::string> env =
      RankEnv(o_, local, master_port_, token_, attempt,
              groups_.enabled() ? groups_.restarts(groups_.GroupOf(r.rank)) : 0);
  auto cannot_start = [&](const absl::Status& s) {
    return absl::Status(s.code(), absl::StrCat("fs_launch: cannot start rank ", r.rank, ": ",
                                               s.message()));
  };
  if (!o_.capture_output) {  // the ranks write to the launcher's own stdout / stderr
    absl::StatusOr<pid_t> pid = base::Spawn(o_.program, o_.args, env, {},
                                            /*new_process_group=*/true);
    if (!pid.ok()) return cannot_start(pid.status());
    r.pid = *pid;
    r.running = true;
    return absl::OkStatus();
  }
  int out[2];
  int err[2];
  if (pipe2(out, O_CLOEXEC) != 0) {
    return absl::InternalError(absl::StrCat("fs_launch: pipe2: ", std::strerror(errno)));
  }
  if (pipe2(err, O_CLOEXEC) != 0) {
    const int e = errno;
    close(out[0]);
    close(out[1]);
    return absl::InternalError(absl::StrCat("fs_launch: pipe2: ", std::strerror(e)));
  }
  absl::StatusOr<pid_t> pid = base::Spawn(o_.program, o_.args, env, {{out[1], 1}, {err[1], 2}},
                                          /*new_process_group=*/true);
  close(out[1]);
  close(err[1]);
  if (!pid.ok()) {
    close(out[0]);
    close(err[0]);
    return cannot_start(pid.status());
  }
  r.pid = *pid;
  r.running = true;
  r.out_fd = out[0];
  r.err_fd = err[0];
  fcntl(r.out_fd, F_SETFL, fcntl(r.out_fd, F_GETFL) | O_NONBLOCK);
  fcntl(r.err_fd, F_SETFL, fcntl(r.err_fd, F_GETFL) | O_NONBLOCK);
  const std::string prefix = o_.prefix_output ? absl::StrCat("[rank ", r.rank, "] ") : "";
  const int out_sink = o_.stdout_fd;
  const int err_sink = o_.stderr_fd;
  r.out = std::make_unique<LinePrefixer>(
      prefix, [out_sink](absl::string_view line) { WriteAll(out_sink, line); });
  r.err = std::make_unique<LinePrefixer>(
      prefix, [err_sink](absl::string_view line) { WriteAll(err_sink, line); });
  return absl::OkStatus();
}

absl::Status Job::SpawnFailed(absl::Status s, const std::string& failed_key) {
  KillAndReapAll();
  if (o_.nnodes > 1) {
    (void)store_.CompareSet(
        failed_key, "",
        EncodeFailure(
            {-1, 127, absl::StrCat("node ", o_.node_rank, " could not start its ranks")}));
  }
  return s;
}

void Job::SignalRanks(int sig) {
  for (const Rank& r : ranks_) SignalRank(r, sig);
}

void Job::SignalRank(const Rank& r, int sig) {
  if (!r.running) return;
  // The whole process group: a rank's own children stop too.
  if (kill(-r.pid, sig) != 0) kill(r.pid, sig);
  if (sig != SIGKILL && kill(-r.pid, SIGCONT) != 0) kill(r.pid, SIGCONT);
}

void Job::KillAndReapAll() {
  SignalRanks(SIGKILL);
  for (Rank& r : ranks_) {
    if (!r.running) continue;
    int wstatus = 0;
    while (waitpid(r.pid, &wstatus, 0) < 0 && errno == EINTR) {
    }
    r.running = false;
  }
  CloseOutputs();
}

void Job::Pump(int& fd, LinePrefixer& prefixer) {
  char buf[64 << 10];
  // Bounded per round so that one chatty rank cannot starve the others or the signal pipe.
  for (int i = 0; i < 16; ++i) {
    const ssize_t n = read(fd, buf, sizeof(buf));
    if (n > 0) {
      prefixer.Feed(absl::string_view(buf, static_cast<size_t>(n)));
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
    prefixer.Flush();  // EOF (or a read error): the last partial line goes out now.
    close(fd);
    fd = -1;
    return;
  }
}

void Job::CloseOutput(Rank& r) {
  if (r.out_fd >= 0) Pump(r.out_fd, *r.out);
  if (r.err_fd >= 0) Pump(r.err_fd, *r.err);
  for (auto [fd, p] :
       {std::make_pair(&r.out_fd, r.out.get()), std::make_pair(&r.err_fd, r.err.get())}) {
    if (*fd >= 0) {
      close(*fd);
      *fd = -1;
    }
    if (p != nullptr) p->Flush();
  }
}

void Job::CloseOutputs() {
  for (Rank& r : ranks_) CloseOutput(r);
}

absl::StatusOr<Outcome> Job::RunAttempt(int attempt) {
  Outcome outcome;
  {
    FS_ASSIGN_OR_RETURN(const int sig, Rendezvous(attempt));
    if (sig != 0) {
      Say(absl::StrCat("received ", SignalName(sig), " before the ranks started"));
      outcome.launcher_signal = sig;
      outcome.status = 128 + sig;
      return outcome;
    }
  }
  const std::string failed_key = Key(attempt, "failed");
  if (absl::Status s = SpawnRanks(attempt); !s.ok()) return SpawnFailed(s, failed_key);

  std::optional<Failure> failure;
  int launcher_signal = 0;
  bool stopping = false;
  bool killed = false;
  absl::Time kill_at = absl::InfiniteFuture();
  absl::Time all_exited_at = absl::InfiniteFuture();
  absl::Time next_store_check = absl::Now() + kStoreCheckPeriod;
  absl::Status store_error;
  // Since when the store has not answered (InfiniteFuture: it answers).
  absl::Time store_lost_at = absl::InfiniteFuture();
  auto stop = [&](int sig) {
    SignalRanks(sig);
    if (!stopping) {
      stopping = true;
      kill_at = absl::Now() + o_.stop_timeout;
    }
  };
  auto running = [&] {
    int n = 0;
    for (const Rank& r : ranks_) n += r.running ? 1 : 0;
    return n;
  };

  while (true) {
    std::vector<pollfd> fds = {{signals_.read_fd(), POLLIN, 0}};
    std::vector<std::pair<int*, LinePrefixer*>> streams;
    for (Rank& r : ranks_) {
      if (r.out_fd >= 0) {
        fds.push_back({r.out_fd, POLLIN, 0});
        streams.push_back({&r.out_fd, r.out.get()});
      }
      if (r.err_fd >= 0) {
        fds.push_back({r.err_fd, POLLIN, 0});
        streams.push_back({&r.err_fd, r.err.get()});
      }
    }
    const int rc = poll(fds.data(), fds.size(), kPollMs);
    if (rc < 0 && errno != EINTR) {
      KillAndReapAll();
      return absl::InternalError(absl::StrCat("fs_launch: poll: ", std::strerror(errno)));
    }
    if (rc > 0) {
      for (size_t i = 0; i < streams.size(); ++i) {
        if (fds[i + 1].revents != 0) Pump(*streams[i].first, *streams[i].second);
      }
    }
    // Signals to the launcher: forward the first, SIGKILL on the second.
    if (const int sig = signals_.Take(); sig != 0) {
      if (launcher_signal == 0) {
        launcher_signal = sig;
        Say(absl::StrCat("received ", SignalName(sig), "; forwarding it to ", running(),
                         " running rank(s) (SIGKILL after ", absl::FormatDuration(o_.stop_timeout),
                         ")"));
        stop(sig);
      } else if (!killed) {
        Say(absl::StrCat("received ", SignalName(sig), " again; sending SIGKILL"));
        SignalRanks(SIGKILL);
        killed = true;
      }
    }
    // Ranks that ended, stopped or continued. All are collected before any failure is acted
    // on, so that a group whose other rank exited 0 meanwhile is known to be done.
    std::vector<std::pair<Rank*, Ending>> ended;
    for (Rank& r : ranks_) {
      if (!r.running) continue;
      std::optional<Ending> e = Reap(r, stopping || GroupRestarting(r));
      if (!e.has_value()) continue;
      r.exited_zero = !r.running && e->status == 0;
      ended.push_back({&r, *std::move(e)});
    }
    for (auto& [rank, e] : ended) {
      const Rank& r = *rank;
      if (e.status == 0 || failure.has_value() || launcher_signal != 0) continue;
      std::string why;
      if (groups_.enabled()) {
        if (GroupRestarting(r)) continue;  // one of the ranks the launcher is stopping
        if (BeginGroupRestart(r, e, why)) continue;
      }
      failure = Failure{r.rank, e.status, absl::StrCat("rank ", r.rank, " ", e.what, why)};
      if (o_.nnodes > 1) {
        // The first failure published wins, so every node reports the same one. An unreachable
        // store does not stop this node from stopping its own ranks.
        absl::StatusOr<std::string> winner =
            store_.CompareSet(failed_key, "", EncodeFailure(*failure));
        if (winner.ok() && *winner != EncodeFailure(*failure)) failure = DecodeFailure(*winner);
        if (!winner.ok()) {
          Say(absl::StrCat("could not tell the other nodes that rank ", r.rank, " failed (",
                           winner.status().message(), ")"));
        }
      }
      Say(absl::StrCat("rank ", r.rank, " (local rank ", r.local_rank, " on node ", o_.node_rank,
                       ", pid ", r.pid, ") ", e.what, why, "; stopping the other ",
                       o_.nproc_per_node * o_.nnodes - 1, " rank(s) (SIGTERM, SIGKILL after ",
                       absl::FormatDuration(o_.stop_timeout), ")"));
      stop(SIGTERM);
    }
    // A failure on another node.
    if (o_.nnodes > 1 && !stopping && absl::Now() >= next_store_check) {
      next_store_check = absl::Now() + kStoreCheckPeriod;
      absl::StatusOr<bool> failed = store_.Check(failed_key);
      if (!failed.ok() && absl::IsDeadlineExceeded(failed.status()) &&
          (store_lost_at == absl::InfiniteFuture() ||
           absl::Now() - store_lost_at < o_.rendezvous_timeout)) {
        // Unreachable (a partition, a link down): keep supervising this node's ranks; their
        // operations time out by themselves if their peers are unreachable too.
        if (store_lost_at == absl::InfiniteFuture()) {
          store_lost_at = absl::Now();
          Say(absl::StrCat("the job store does not answer (", failed.status().message(),
                           "); still supervising the ranks of node ", o_.node_rank,
                           ", failing the job if it does not answer within ",
                           absl::FormatDuration(o_.rendezvous_timeout)));
        }
      } else if (!failed.ok()) {
        store_error = failed.status();
        Say(absl::StrCat("lost the job store (", store_error.message(),
                         "); stopping the ranks of this node"));
        stop(SIGTERM);
      } else if (store_lost_at != absl::InfiniteFuture() && !*failed) {
        Say(absl::StrCat("the job store answers again after ",
                         absl::FormatDuration(absl::Trunc(absl::Now() - store_lost_at,
                                                          absl::Milliseconds(100)))));
        store_lost_at = absl::InfiniteFuture();
      } else if (*failed) {
        absl::StatusOr<std::string> v = store_.Get(failed_key, absl::Seconds(10));
        failure = v.ok() ? DecodeFailure(*v) : Failure{-1, 1, "another node failed"};
        Say(absl::StrCat(failure->what, " (another node); stopping the ", running(),
                         " rank(s) of node ", o_.node_rank));
        stop(SIGTERM);
      }
    }
    if (groups_.enabled() && !stopping) {
      if (absl::Status s = AdvanceGroupRestarts(attempt); !s.ok()) {
        return SpawnFailed(s, failed_key);
      }
    }
    if (stopping && !killed && absl::Now() >= kill_at && running() > 0) {
      Say(absl::StrCat(running(), " rank(s) still running ", absl::FormatDuration(o_.stop_timeout),
                       " after SIGTERM; sending SIGKILL"));
      SignalRanks(SIGKILL);
      killed = true;
    }
    if (running() == 0) {
      if (all_exited_at == absl::InfiniteFuture()) all_exited_at = absl::Now();
      bool open = false;
      for (const Rank& r : ranks_) open = open || r.out_fd >= 0 || r.err_fd >= 0;
      if (!open || absl::Now() - all_exited_at > kOutputDrain) break;
    }
  }
  CloseOutputs();

  if (launcher_signal != 0) {
    outcome.launcher_signal = launcher_signal;
    outcome.status = 128 + launcher_signal;
    return outcome;
  }
  if (!store_error.ok()) return store_error;
  if (failure.has_value()) {
    outcome.status = failure->status;
    outcome.failure = std::move(failure);
    return outcome;
  }
  if (o_.nnodes > 1) return AwaitOtherNodes(attempt);
  return outcome;
}

std::optional<Ending> Job::Reap(Rank& r, bool quiet) {
  int wstatus = 0;
  const pid_t w = waitpid(r.pid, &wstatus, WNOHANG | WUNTRACED | WCONTINUED);
  if (w != r.pid) {
    // Still stopped past its grace: a failure like a kill by that signal.
    if (r.stopped_since == absl::InfiniteFuture() ||
        absl::Now() - r.stopped_since < o_.stopped_timeout) {
      return std::nullopt;
    }
    Ending e = {128 + r.stop_signal,
                absl::StrCat("has been stopped by ", SignalName(r.stop_signal), " for ",
                             absl::FormatDuration(absl::Trunc(absl::Now() - r.stopped_since,
                                                              absl::Milliseconds(100))),
                             " (status ", 128 + r.stop_signal, ")")};
    r.stopped_since = absl::InfiniteFuture();  // reported once; SIGTERM + SIGCONT follow
    return e;
  }
  if (WIFSTOPPED(wstatus)) {
    if (r.stopped_since == absl::InfiniteFuture() && !quiet) {
      r.stopped_since = absl::Now();
      r.stop_signal = WSTOPSIG(wstatus);
      Say(absl::StrCat("rank ", r.rank, " (local rank ", r.local_rank, " on node ", o_.node_rank,
                       ", pid ", r.pid, ") was stopped by ", SignalName(r.stop_signal),
                       "; the job fails if it is still stopped in ",
                       absl::FormatDuration(o_.stopped_timeout)));
    }
    return std::nullopt;
  }
  if (WIFCONTINUED(wstatus)) {
    if (r.stopped_since != absl::InfiniteFuture() && !quiet) {
      Say(absl::StrCat("rank ", r.rank, " (pid ", r.pid, ") continued after ",
                       absl::FormatDuration(absl::Trunc(absl::Now() - r.stopped_since,
                                                        absl::Milliseconds(100)))));
    }
    r.stopped_since = absl::InfiniteFuture();
    return std::nullopt;
  }
  r.running = false;
  return FromWaitStatus(wstatus);
}

bool Job::BeginGroupRestart(const Rank& failed, const Ending& e, std::string& why) {
  const int g = groups_.GroupOf(failed.rank);
  const std::string group = absl::StrCat("replica group ", g, " (", groups_.RanksOf(g));
  for (int local : groups_.LocalRanksOf(g)) {
    if (ranks_[local].exited_zero) {
      why = absl::StrCat(" (", group, ") is not restarted: rank ", ranks_[local].rank,
                         " had already exited 0)");
      return false;
    }
  }
  if (!groups_.HasRestartsLeft(g)) {
    why = absl::StrCat(" (", group, ") is out of restarts: ", groups_.restarts(g), " of at most ",
                       o_.max_restarts, ")");
    return false;
  }
  groups_.BeginRestart(g, absl::Now() + o_.stop_timeout);
  Say(absl::StrCat("rank ", failed.rank, " (local rank ", failed.local_rank, " on node ",
                   o_.node_rank, ", pid ", failed.pid, ") ", e.what, "; restarting ", group,
                   ", restart ", groups_.restarts(g), " of at most ", o_.max_restarts,
                   "); the other groups keep running"));
  for (int local : groups_.LocalRanksOf(g)) SignalRank(ranks_[local], SIGTERM);
  return true;
}

absl::Status Job::AdvanceGroupRestarts(int attempt) {
  for (int g : groups_.Restarting()) {
    const std::vector<int> locals = groups_.LocalRanksOf(g);
    int running = 0;
    for (int local : locals) running += ranks_[local].running ? 1 : 0;
    if (running == 0) {
      for (int local : locals) FS_RETURN_IF_ERROR(SpawnRank(local, attempt));
      groups_.EndRestart(g);
      Say(absl::StrCat("replica group ", g, " restarted (", groups_.RanksOf(g),
                       ", FS_RESTART_COUNT=", groups_.restarts(g), ")"));
    } else if (groups_.KillDue(g, absl::Now())) {
      Say(absl::StrCat("replica group ", g, ": ", running, " rank(s) still running ",
                       absl::FormatDuration(o_.stop_timeout), " after SIGTERM; sending SIGKILL"));
      for (int local : locals) SignalRank(ranks_[local], SIGKILL);
      groups_.MarkKilled(g);
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<Outcome> Job::AwaitOtherNodes(int attempt) {
  Outcome outcome;
  // One key per node (idempotent, so requests that timed out can be retried).
  std::vector<std::string> finished;
  for (int n = 0; n < o_.nnodes; ++n) {
    finished.push_back(Key(attempt, absl::StrCat("finished/", n)));
  }
  const std::string failed_key = Key(attempt, "failed");
  const absl::Time deadline = absl::Now() + o_.rendezvous_timeout;
  bool said = false;
  bool set = false;
  while (true) {
    if (const int sig = signals_.Take(); sig != 0) {
      Say(absl::StrCat("received ", SignalName(sig), " while waiting for the other nodes"));
      outcome.launcher_signal = sig;
      outcome.status = 128 + sig;
      return outcome;
    }
    absl::Status s;
    if (!set) {
      s = store_.Set(finished[o_.node_rank], "1");
      set = s.ok();
    }
    if (s.ok()) {
      absl::StatusOr<bool> failed = store_.Check(failed_key);
      if (failed.ok() && *failed) {
        FS_ASSIGN_OR_RETURN(std::string v, store_.Get(failed_key, absl::Seconds(10)));
        outcome.failure = DecodeFailure(v);
        outcome.status = outcome.failure->status;
        Say(absl::StrCat(outcome.failure->what, " (another node)"));
        return outcome;
      }
      s = failed.ok() ? store_.Wait(finished, absl::Milliseconds(100)) : failed.status();
      if (s.ok()) return outcome;
    }
    if (!absl::IsDeadlineExceeded(s)) return s;
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat(
          "fs_launch: node ", o_.node_rank, ": the ranks of this node finished, but the other "
          "nodes did not within ", absl::FormatDuration(o_.rendezvous_timeout), " (",
          s.message(), ")"));
    }
    if (!said) {
      Say(absl::StrCat("the ranks of node ", o_.node_rank,
                       " exited with code 0; waiting for the other nodes"));
      said = true;
    }
  }
}

absl::Status Job::FinishJob(int attempt) {
  if (o_.nnodes == 1) return absl::OkStatus();
  const std::string mine = Key(attempt, absl::StrCat("acked/", o_.node_rank));
  if (o_.node_rank != 0) {
    // Best effort: node 0 stops waiting for it soon anyway, and the job's outcome is known.
    if (absl::Status s = store_.Set(mine, "1"); !s.ok()) {
      Say(absl::StrCat("could not tell node 0 that this node read the outcome (", s.message(),
                       ")"));
    }
    return absl::OkStatus();
  }
  // Node 0 hosts the store: it leaves last, so the others read the outcome rather than a
  // closed connection. Bounded by how long they take to stop their ranks once they read it: a
  // node that died or is cut off will never ack.
  std::vector<std::string> acked;
  for (int n = 1; n < o_.nnodes; ++n) acked.push_back(Key(attempt, absl::StrCat("acked/", n)));
  const absl::Time deadline =
      absl::Now() + o_.stop_timeout + kOutputDrain + kStoreCheckPeriod + kFinishGrace;
  while (absl::Now() < deadline && signals_.Take() == 0) {
    const absl::Status s = store_.Wait(acked, absl::Milliseconds(50));
    if (s.ok()) return absl::OkStatus();
    if (!absl::IsDeadlineExceeded(s)) return s;
  }
  return absl::OkStatus();
}

}  // namespace

std::string NewStoreToken() {
  absl::BitGen gen;
  return absl::StrFormat("%016x%016x", absl::Uniform<uint64_t>(gen), absl::Uniform<uint64_t>(gen));
}

absl::Status ValidateLaunchOptions(const LaunchOptions& o) {
  auto bad = [](auto&&... parts) {
    return absl::InvalidArgumentError(absl::StrCat("fs_launch: ", parts...));
  };
  if (o.program.empty()) return bad("no program to launch (fs_launch [flags] -- program args)");
  if (o.nproc_per_node < 1) return bad("--nproc_per_node=", o.nproc_per_node, " must be >= 1");
  if (o.nnodes < 1) return bad("--nnodes=", o.nnodes, " must be >= 1");
  if (o.node_rank < 0 || o.node_rank >= o.nnodes) {
    return bad("--node_rank=", o.node_rank, " is outside [0, --nnodes=", o.nnodes, ")");
  }
  if (o.master_addr.empty()) return bad("--master_addr is empty");
  if (o.master_port < 0 || o.master_port > 65535) {
    return bad("--master_port=", o.master_port, " is outside [0, 65535]");
  }
  if (o.master_port == 0 && o.nnodes > 1) {
    return bad(
        "--master_port=0 (pick a free port) needs --nnodes=1: the other nodes could not "
        "know the port; give every node the same fixed --master_port");
  }
  if (o.max_restarts < 0) return bad("--max_restarts=", o.max_restarts, " must be >= 0");
  if (o.replica_group_size < 0) {
    return bad("--replica_group_size=", o.replica_group_size, " must be >= 0 (0: no groups)");
  }
  if (o.replica_group_size > 0 && o.nproc_per_node % o.replica_group_size != 0) {
    return bad("--replica_group_size=", o.replica_group_size,
               " must divide --nproc_per_node=", o.nproc_per_node,
               ": a replica group lies within one node");
  }
  if (o.stop_timeout < absl::ZeroDuration()) return bad("the stop timeout must be >= 0");
  if (o.stopped_timeout < absl::ZeroDuration()) {
    return bad("the stopped-rank timeout must be >= 0");
  }
  if (o.rendezvous_timeout <= absl::ZeroDuration()) {
    return bad("the rendezvous timeout must be positive");
  }
  if (static_cast<int64_t>(o.nproc_per_node) * o.nnodes > (1 << 24)) {
    return bad("--nproc_per_node * --nnodes is too large");
  }
  return absl::OkStatus();
}

std::vector<std::string> RankEnv(const LaunchOptions& o, int local_rank, int master_port,
                                 const std::string& token, int attempt, int group_restarts) {
  std::vector<std::string> env = o.env;
  const int rank = o.node_rank * o.nproc_per_node + local_rank;
  env.push_back(absl::StrCat("RANK=", rank));
  env.push_back(absl::StrCat("LOCAL_RANK=", local_rank));
  env.push_back(absl::StrCat("WORLD_SIZE=", o.nproc_per_node * o.nnodes));
  env.push_back(absl::StrCat("LOCAL_WORLD_SIZE=", o.nproc_per_node));
  env.push_back(absl::StrCat("GROUP_RANK=", o.node_rank));
  env.push_back(absl::StrCat("MASTER_ADDR=", o.master_addr));
  env.push_back(absl::StrCat("MASTER_PORT=", master_port));
  env.push_back("TORCHELASTIC_USE_AGENT_STORE=True");
  const int restarts = o.replica_group_size > 0 ? group_restarts : attempt;
  env.push_back(absl::StrCat("TORCHELASTIC_RESTART_COUNT=", restarts));
  env.push_back(absl::StrCat("TORCHELASTIC_MAX_RESTARTS=", o.max_restarts));
  env.push_back(absl::StrCat("FS_RESTART_COUNT=", restarts));
  if (o.replica_group_size > 0) {
    env.push_back(absl::StrCat("FS_REPLICA_GROUP=", rank / o.replica_group_size));
    env.push_back(absl::StrCat("FS_REPLICA_GROUP_SIZE=", o.replica_group_size));
    env.push_back(absl::StrCat("FS_NUM_REPLICA_GROUPS=",
                               o.nproc_per_node * o.nnodes / o.replica_group_size));
  }
  env.push_back(absl::StrCat("FS_STORE_TOKEN=", token));
  env.push_back(absl::StrCat("FS_STORE_PREFIX=fs_launch/", attempt, "/job"));
  // The launcher prefixes every output line with "[rank N] ": the program need not.
  if (o.capture_output && o.prefix_output) env.push_back("FS_OUTPUT_PREFIXED=1");
  return env;
}

absl::StatusOr<int> Launch(const LaunchOptions& o) {
  FS_RETURN_IF_ERROR(ValidateLaunchOptions(o));
  std::string token = o.store_token;
  if (token.empty()) {
    const char* env_token = std::getenv("FS_STORE_TOKEN");
    if (env_token != nullptr && *env_token != '\0') {
      token = env_token;
    } else if (o.nnodes == 1) {
      token = NewStoreToken();
    } else {
      return absl::InvalidArgumentError(
          "fs_launch: with --nnodes > 1 every node's launcher needs the same job token: "
          "export FS_STORE_TOKEN=<secret> on every node (e.g. $(openssl rand -hex 16))");
    }
  }
  FS_ASSIGN_OR_RETURN(std::unique_ptr<SignalPipe> signals, SignalPipe::Install());

  comm::TCPStoreOptions so;
  so.token = token;
  so.timeout = o.rendezvous_timeout;
  if (o.nnodes > 1) so.request_timeout = kStoreRequestTimeout;
  if (o.node_rank == 0) {
    so.is_server = true;
    so.host = !o.store_bind_addr.empty() ? o.store_bind_addr
              : o.nnodes == 1            ? o.master_addr
                                         : "0.0.0.0";
    so.port = o.master_port;
  } else {
    so.host = o.master_addr;
    so.port = o.master_port;
  }
  absl::StatusOr<std::unique_ptr<comm::TCPStore>> store = comm::TCPStore::Create(so);
  if (!store.ok()) {
    std::string hint;
    if (o.node_rank == 0 && o.master_port != 0 &&
        absl::StrContains(store.status().message(), std::strerror(EADDRINUSE))) {
      hint = absl::StrCat("; another process holds port ", o.master_port,
                          o.nnodes == 1 ? ": pass --master_port=0 to pick a free one"
                                        : ": pick a free --master_port on every node");
    }
    return absl::Status(store.status().code(),
                        absl::StrCat("fs_launch: node ", o.node_rank,
                                     ": the job store: ", store.status().message(), hint));
  }
  const int master_port = (*store)->port();

  Job job(o, **store, master_port, token, *signals);
  for (int attempt = 0;; ++attempt) {
    FS_ASSIGN_OR_RETURN(Outcome outcome, job.RunAttempt(attempt));
    if (outcome.launcher_signal != 0) return outcome.status;
    if (!outcome.failure.has_value()) {
      FS_RETURN_IF_ERROR(job.FinishJob(attempt));
      return 0;
    }
    // With replica groups the failed group had its restarts: the job is over.
    if (o.replica_group_size == 0 && attempt < o.max_restarts) {
      job.Say(absl::StrCat(outcome.failure->what, "; restarting the job (restart ", attempt + 1,
                           " of at most ", o.max_restarts, ", FS_RESTART_COUNT=", attempt + 1,
                           ")"));
      continue;
    }
    job.Say(absl::StrCat(
        "job failed: ", outcome.failure->what,
        o.max_restarts > 0 && o.replica_group_size == 0
            ? absl::StrCat(" (after ", o.max_restarts, " restart(s))")
            : "",
        "; exit status ", outcome.status));
    FS_RETURN_IF_ERROR(job.FinishJob(attempt));
    return outcome.status;
  }
}

}  // namespace fairscale::launch
