#include "ft/membership.h"

#include <algorithm>
#include <random>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "base/status_macros.h"
#include "comm/replace.h"
#include "comm/store/prefix_store.h"

namespace fairscale::ft {
namespace {

// Bound of the store calls that must not wait (the key is known to exist, or absence is an answer).
constexpr absl::Duration kStoreCallTimeout = absl::Seconds(10);

std::string HeartbeatKey(int g, int s) { return absl::StrCat("hb/g", g, "/s", s); }
std::string ArriveKey(int64_t r, int g, int s) { return absl::StrCat("arrive/", r, "/g", g, "/s", s); }
std::string RoundKey(int64_t r) { return absl::StrCat("round/", r); }
std::string VoteKey(int64_t r, int g, int s) { return absl::StrCat("vote/", r, "/g", g, "/s", s); }
// Rounds kept in the store: a rank of round r reads rounds r - 1 and r only; a rank coming back
// reads "latest" and the rounds after it.
constexpr int64_t kKeepRounds = 16;

// What round r decided (the value of "round/<r>", one field per line).
struct Decision {
  int64_t epoch = 0;
  int64_t max_step = 0;
  std::vector<int> groups, joiners, sources, dropped;
  std::vector<std::string> reasons;
};

std::string Ints(const std::vector<int>& v) { return absl::StrJoin(v, ","); }

std::string Encode(const Decision& d) {
  std::string out = absl::StrCat("epoch ", d.epoch, "\nmax_step ", d.max_step, "\ngroups ",
                                 Ints(d.groups), "\njoiners ", Ints(d.joiners), "\nsources ",
                                 Ints(d.sources), "\ndropped ", Ints(d.dropped), "\n");
  for (const std::string& why : d.reasons) {
    absl::StrAppend(&out, "reason ", absl::StrReplaceAll(why, {{"\n", " "}}), "\n");
  }
  return out;
}

absl::StatusOr<std::vector<int>> ParseInts(absl::string_view s) {
  std::vector<int> out;
  for (absl::string_view part : absl::StrSplit(s, ',', absl::SkipEmpty())) {
    int v;
    if (!absl::SimpleAtoi(part, &v)) return absl::DataLossError(absl::StrCat("bad list '", s, "'"));
    out.push_back(v);
  }
  return out;
}

absl::StatusOr<Decision> Decode(absl::string_view text) {
  Decision d;
  for (absl::string_view line : absl::StrSplit(text, '\n', absl::SkipEmpty())) {
    std::pair<absl::string_view, absl::string_view> kv = absl::StrSplit(line, absl::MaxSplits(' ', 1));
    const absl::string_view k = kv.first, v = kv.second;
    if (k == "epoch") {
      if (!absl::SimpleAtoi(v, &d.epoch)) return absl::DataLossError("bad epoch");
    } else if (k == "max_step") {
      if (!absl::SimpleAtoi(v, &d.max_step)) return absl::DataLossError("bad max_step");
    } else if (k == "groups") {
      FS_ASSIGN_OR_RETURN(d.groups, ParseInts(v));
    } else if (k == "joiners") {
      FS_ASSIGN_OR_RETURN(d.joiners, ParseInts(v));
    } else if (k == "sources") {
      FS_ASSIGN_OR_RETURN(d.sources, ParseInts(v));
    } else if (k == "dropped") {
      FS_ASSIGN_OR_RETURN(d.dropped, ParseInts(v));
    } else if (k == "reason") {
      d.reasons.emplace_back(v);
    }
  }
  return d;
}

bool Contains(const std::vector<int>& v, int x) { return std::find(v.begin(), v.end(), x) != v.end(); }

absl::Status Annotate(const absl::Status& s, absl::string_view what) {
  return absl::Status(s.code(), absl::StrCat(what, ": ", s.message()));
}

}  // namespace

struct Membership::State {
  struct RankView {
    std::string value;  // last value read of its heartbeat key ("" = never seen)
    absl::Time last_change;
  };

  State(std::shared_ptr<comm::Store> s, const Options& o)
      : store(std::move(s)), options(o), views(o.num_groups * o.group_size) {
    std::random_device rd;
    nonce = absl::StrCat(absl::Hex((uint64_t{rd()} << 32) | rd()));
    started = absl::Now();
    for (RankView& v : views) v.last_change = started;
  }

  const std::shared_ptr<comm::Store> store;
  const Options options;
  std::string nonce;
  absl::Time started;
  std::thread thread;

  mutable absl::Mutex mu;
  bool stop ABSL_GUARDED_BY(mu) = false;
  bool beating ABSL_GUARDED_BY(mu) = true;
  int64_t count ABSL_GUARDED_BY(mu) = 0;
  std::vector<RankView> views ABSL_GUARDED_BY(mu);
  absl::Time last_sample_ok ABSL_GUARDED_BY(mu);
  absl::Time last_sample_attempt ABSL_GUARDED_BY(mu);
  absl::Status last_store_error ABSL_GUARDED_BY(mu);
  std::vector<QuorumRecord> history ABSL_GUARDED_BY(mu);

  // Only the quorum() thread touches these.
  bool has_prev = false;
  int64_t prev_round = -1;
  Decision prev;

  // One heartbeat write (nothing once stopped or no longer beating).
  absl::Status BeatOnce() {
    std::string value;
    {
      absl::MutexLock lock(&mu);
      if (stop || !beating) return absl::OkStatus();
      value = absl::StrCat(nonce, ":", ++count);
    }
    absl::Status s = store->Set(HeartbeatKey(options.group, options.shard), value);
    if (!s.ok()) {
      absl::MutexLock lock(&mu);
      last_store_error = s;
    }
    return s;
  }

  void Beat() {
    for (;;) {
      {
        absl::MutexLock lock(&mu);
        if (stop) return;
      }
      (void)BeatOnce();
      Sample();
      absl::MutexLock lock(&mu);
      auto stopped = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return stop; };
      mu.AwaitWithTimeout(absl::Condition(&stopped), options.heartbeat_interval);
      if (stop) return;
    }
  }

  // Reads every rank's heartbeat key; a pass counts only when every read answered.
  void Sample() {
    std::vector<std::string> values(views.size());
    const absl::Time t0 = absl::Now();
    for (int g = 0; g < options.num_groups; ++g) {
      for (int s = 0; s < options.group_size; ++s) {
        absl::StatusOr<bool> present = store->Check(HeartbeatKey(g, s));
        absl::StatusOr<std::string> v = present.ok() && *present
                                             ? store->Get(HeartbeatKey(g, s), kStoreCallTimeout)
                                             : absl::StatusOr<std::string>(std::string());
        if (!present.ok() || !v.ok()) {
          absl::MutexLock lock(&mu);
          last_store_error = present.ok() ? v.status() : present.status();
          last_sample_attempt = t0;
          return;
        }
        values[g * options.group_size + s] = *std::move(v);
      }
    }
    const absl::Time now = absl::Now();
    absl::MutexLock lock(&mu);
    for (size_t i = 0; i < views.size(); ++i) {
      if (values[i] != views[i].value) {
        views[i].value = values[i];
        views[i].last_change = now;
      }
    }
    last_sample_ok = now;
    last_sample_attempt = now;
  }

  // Why group g is dead in this rank's view, or "" while it lives.
  std::string DeadReason(int g) const {
    absl::MutexLock lock(&mu);
    if (last_sample_ok == absl::Time()) return "";
    for (int s = 0; s < options.group_size; ++s) {
      const RankView& v = views[g * options.group_size + s];
      if (absl::StartsWith(v.value, "failed:")) {
        return absl::StrCat("group ", g, ": rank ", s, " reported a failure (",
                            v.value.substr(v.value.find(':', 7) + 1), ")");
      }
      if (absl::StartsWith(v.value, "done:")) return absl::StrCat("group ", g, ": rank ", s, " left");
      const absl::Duration silent = last_sample_ok - v.last_change;
      // A rank that never beat is still starting (processes of a job start unevenly on a busy
      // machine): dead only after start_timeout.
      if (silent >= (v.value.empty() ? std::max(options.start_timeout, options.dead_after)
                                     : options.dead_after)) {
        return absl::StrCat("group ", g, ": rank ", s,
                            v.value.empty() ? " never sent a heartbeat in " : " missed heartbeats for ",
                            absl::FormatDuration(absl::Trunc(silent, absl::Milliseconds(1))));
      }
    }
    return "";
  }

  // DeadReason after a fresh sample when the last one says g is dead: the heartbeat thread samples
  // every heartbeat_interval, and a group that came back (a new incarnation beating, arrived for
  // this round) since then must not be judged on the older sample (that dropped a joiner right
  // after its admission when the steps were shorter than the interval).
  std::string FreshDeadReason(int g) {
    if (DeadReason(g).empty()) return "";
    Sample();
    return DeadReason(g);
  }

  absl::Status StoreHealth() const {
    absl::MutexLock lock(&mu);
    const absl::Time since = last_sample_ok == absl::Time() ? started : last_sample_ok;
    if (absl::Now() - since > options.dead_after + options.heartbeat_interval) {
      return absl::UnavailableError(absl::StrCat(
          "membership group ", options.group, " rank ", options.shard,
          ": the store has not answered the heartbeat thread for ",
          absl::FormatDuration(absl::Trunc(absl::Now() - since, absl::Milliseconds(1))),
          last_store_error.ok() ? "" : absl::StrCat(" (last error: ", last_store_error.ToString(), ")")));
    }
    return absl::OkStatus();
  }

  void StopBeating(std::string final_value) {
    {
      absl::MutexLock lock(&mu);
      if (!beating) return;
      beating = false;
    }
    (void)store->Set(HeartbeatKey(options.group, options.shard), final_value);
  }
};

absl::StatusOr<std::unique_ptr<Membership>> Membership::Create(std::shared_ptr<comm::Store> store,
                                                               Options options) {
  if (store == nullptr) return absl::InvalidArgumentError("Membership: no store");
  if (options.num_groups < 1 || options.group_size < 1 || options.group < 0 ||
      options.group >= options.num_groups || options.shard < 0 ||
      options.shard >= options.group_size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Membership: group ", options.group, " shard ", options.shard, " is not in a job of ",
        options.num_groups, " groups x ", options.group_size, " ranks"));
  }
  if (options.min_groups < 1 || options.min_groups > options.num_groups) {
    return absl::InvalidArgumentError(
        absl::StrCat("Membership: min_groups ", options.min_groups, " not in [1, ", options.num_groups, "]"));
  }
  if (options.heartbeat_interval <= absl::ZeroDuration() || options.dead_after <= options.heartbeat_interval ||
      options.poll_interval <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        "Membership: need heartbeat_interval > 0, dead_after > heartbeat_interval, poll_interval > 0");
  }
  auto ns = std::make_shared<comm::PrefixStore>(options.name, std::move(store));
  std::unique_ptr<Membership> m(new Membership(std::move(ns), std::move(options)));
  // The first beat before returning: a rank that arrives in a round has always beaten (one that
  // never did counts as still starting, for start_timeout).
  if (absl::Status s = m->state_->BeatOnce(); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("Membership: the first heartbeat: ", s.message()));
  }
  return m;
}

Membership::Membership(std::shared_ptr<comm::Store> store, Options options)
    : store_(std::move(store)), options_(std::move(options)),
      state_(std::make_shared<State>(store_, options_)) {
  state_->thread = std::thread([s = state_] { s->Beat(); });
}

Membership::~Membership() {
  {
    absl::MutexLock lock(&state_->mu);
    state_->stop = true;
  }
  state_->thread.join();  // store calls are bounded
}

void Membership::ReportFailure(const absl::Status& why) {
  state_->StopBeating(absl::StrCat("failed:", state_->nonce, ":", why.ToString()));
}

void Membership::Leave() { state_->StopBeating(absl::StrCat("done:", state_->nonce)); }

std::vector<int> Membership::live_groups() const {
  std::vector<int> out;
  for (int g = 0; g < options_.num_groups; ++g) {
    bool beating = true;
    {
      absl::MutexLock lock(&state_->mu);
      if (state_->last_sample_ok == absl::Time()) return out;
      for (int s = 0; s < options_.group_size; ++s) {
        beating = beating && !state_->views[g * options_.group_size + s].value.empty();
      }
    }
    if (beating && state_->DeadReason(g).empty()) out.push_back(g);
  }
  return out;
}

std::vector<QuorumRecord> Membership::history() const {
  absl::MutexLock lock(&state_->mu);
  return state_->history;
}

absl::StatusOr<Quorum> Membership::quorum(int64_t step, absl::Duration timeout) {
  State& st = *state_;
  const Options& o = options_;
  const absl::Time start = absl::Now();
  const absl::Time deadline = start + timeout;
  const std::string who = absl::StrCat("quorum (step ", step, ", group ", o.group, " rank ", o.shard, ")");

  // Which round to announce for: the next one for a member, the first undecided one otherwise.
  int64_t r = 0;
  if (st.has_prev) {
    r = st.prev_round + 1;
  } else {
    FS_ASSIGN_OR_RETURN(bool has_latest, store_->Check("latest"));
    if (has_latest) {
      FS_ASSIGN_OR_RETURN(std::string latest, store_->Get("latest", kStoreCallTimeout));
      if (!absl::SimpleAtoi(latest, &r)) return absl::DataLossError("bad 'latest' in the store");
    }
    for (;;) {
      FS_ASSIGN_OR_RETURN(bool decided, store_->Check(RoundKey(r)));
      if (!decided) break;
      ++r;
    }
  }

  absl::Time below_min_since = absl::InfiniteFuture();
  for (;;) {  // one iteration per round announced
    // "<step> member" from a rank of round r - 1, "<step> new" from a new incarnation (or a rank
    // that missed rounds): a group with a new rank needs the state even when the round before
    // still lists it (restarted faster than its peers judged it dead).
    const bool member_before =
        st.has_prev && st.prev_round == r - 1 && Contains(st.prev.groups, o.group);
    FS_RETURN_IF_ERROR(store_->Set(ArriveKey(r, o.group, o.shard),
                                   absl::StrCat(step, member_before ? " member" : " new")));
    Decision prev;
    if (r > 0) {
      if (st.has_prev && st.prev_round == r - 1) {
        prev = st.prev;
      } else {
        FS_ASSIGN_OR_RETURN(std::string text, store_->Get(RoundKey(r - 1), kStoreCallTimeout));
        FS_ASSIGN_OR_RETURN(prev, Decode(text));
      }
    }
    const bool was_member = st.has_prev && st.prev_round == r - 1 && Contains(st.prev.groups, o.group);
    std::vector<int> expected;
    if (r == 0) {
      for (int g = 0; g < o.num_groups; ++g) expected.push_back(g);
    } else {
      expected = prev.groups;
    }

    std::string waiting_for;
    for (;;) {  // poll round r
      FS_RETURN_IF_ERROR(st.StoreHealth());
      FS_ASSIGN_OR_RETURN(bool decided, store_->Check(RoundKey(r)));
      if (decided) {
        FS_ASSIGN_OR_RETURN(std::string text, store_->Get(RoundKey(r), kStoreCallTimeout));
        FS_ASSIGN_OR_RETURN(Decision d, Decode(text));
        if (!Contains(d.groups, o.group)) {
          if (was_member) {
            return absl::AbortedError(absl::StrCat(
                who, ": this group was left out of round ", r, " (epoch ", d.epoch,
                ", groups ", Ints(d.groups), "): its peers judged it dead (",
                absl::StrJoin(d.reasons, "; "), "); restart the group to rejoin"));
          }
          if (absl::Now() >= deadline) {
            return absl::DeadlineExceededError(absl::StrCat(
                who, ": not admitted within ", absl::FormatDuration(timeout), "; round ", r,
                " was decided without this group (a rank of it had not arrived, or the deciding "
                "rank had not yet seen its heartbeats)"));
          }
          ++r;  // arrived too late for round r: try the next one
          break;
        }
        Quorum q;
        q.round = r;
        q.epoch = d.epoch;
        q.step = step;
        q.groups = d.groups;
        q.replicate_rank = std::find(d.groups.begin(), d.groups.end(), o.group) - d.groups.begin();
        q.replicate_size = d.groups.size();
        q.changed = r == 0 || !was_member || d.epoch != prev.epoch;
        q.joiners = d.joiners;
        q.sources = d.sources;
        for (size_t i = 0; i < d.joiners.size(); ++i) {
          if (d.joiners[i] == o.group) {
            q.joining = true;
            q.source_group = d.sources[i];
          }
        }
        q.max_step = d.max_step;
        q.dropped = d.dropped;
        q.dropped_reasons = d.reasons;
        q.group = o.group;
        q.shard = o.shard;
        st.has_prev = true;
        st.prev_round = r;
        st.prev = std::move(d);
        if (o.shard == 0) {  // raise the hint for groups coming back
          std::string seen;
          for (int i = 0; i < 100; ++i) {
            int64_t cur = -1;
            if (!seen.empty() && !absl::SimpleAtoi(seen, &cur)) break;
            if (cur >= r) break;
            absl::StatusOr<std::string> now = store_->CompareSet("latest", seen, absl::StrCat(r));
            if (!now.ok()) break;
            seen = *now;
          }
        }
        // The keys of round r - kKeepRounds go (by one rank: shard 0 of the round's first group),
        // so the store holds a bounded number of rounds however long the job runs. Best effort.
        if (r >= kKeepRounds && o.shard == 0 && o.group == q.groups.front()) {
          const int64_t old = r - kKeepRounds;
          (void)store_->Delete(RoundKey(old));
          (void)store_->Delete(absl::StrCat("commit/", old));
          for (int g = 0; g < o.num_groups; ++g) {
            for (int s = 0; s < o.group_size; ++s) {
              (void)store_->Delete(ArriveKey(old, g, s));
              (void)store_->Delete(VoteKey(old, g, s));
            }
          }
        }
        QuorumRecord rec{q.round, q.epoch, step, q.groups, q.joiners, q.dropped, absl::Now() - start};
        {
          absl::MutexLock lock(&st.mu);
          st.history.push_back(rec);
        }
        if (q.changed && o.on_change) o.on_change(q);
        return q;
      }

      // A rank that was not a member: round r may have been decided and pruned while this rank
      // was away ("latest" >= r): go on to the first undecided round after it.
      if (!was_member) {
        FS_ASSIGN_OR_RETURN(bool has_latest, store_->Check("latest"));
        int64_t latest = -1;
        if (has_latest) {
          FS_ASSIGN_OR_RETURN(std::string v, store_->Get("latest", kStoreCallTimeout));
          if (!absl::SimpleAtoi(v, &latest)) return absl::DataLossError("bad 'latest' in the store");
        }
        if (latest >= r) {
          r = latest + 1;
          break;
        }
      }
      // Not decided yet: decide it when every group of the previous round arrived or is dead.
      std::vector<int> complete;
      std::vector<int64_t> steps;
      for (int g = 0; g < o.num_groups; ++g) {
        int arrived = 0;
        for (int s = 0; s < o.group_size; ++s) {
          FS_ASSIGN_OR_RETURN(bool a, store_->Check(ArriveKey(r, g, s)));
          arrived += a;
        }
        if (arrived == o.group_size) complete.push_back(g);
      }
      Decision d;
      waiting_for.clear();
      for (int g : expected) {
        if (Contains(complete, g)) continue;
        std::string why = st.FreshDeadReason(g);
        if (why.empty()) {
          absl::StrAppend(&waiting_for, waiting_for.empty() ? "" : ",", g);
        } else {
          d.dropped.push_back(g);
          d.reasons.push_back(std::move(why));
        }
      }
      if (waiting_for.empty()) {
        for (int g : complete) {
          if (Contains(expected, g) || st.FreshDeadReason(g).empty()) d.groups.push_back(g);
        }
        if (static_cast<int>(d.groups.size()) < o.min_groups) {
          const absl::Time now = absl::Now();
          below_min_since = std::min(below_min_since, now);
          if (now - below_min_since >= o.below_min_wait) {
            return absl::UnavailableError(absl::StrCat(
                who, ": round ", r, " would have ", d.groups.size(), " live group(s) (",
                Ints(d.groups), "), fewer than min_groups ", o.min_groups, " for ",
                absl::FormatDuration(o.below_min_wait), "; dropped: ", absl::StrJoin(d.reasons, "; ")));
          }
          waiting_for = absl::StrCat("min_groups ", o.min_groups);
        } else {
          bool discarded = false;  // round r - 1's step was voted down: its communicators are suspect
          if (r > 0) {
            FS_ASSIGN_OR_RETURN(bool voted, store_->Check(absl::StrCat("commit/", r - 1)));
            if (voted) {
              FS_ASSIGN_OR_RETURN(std::string v, store_->Get(absl::StrCat("commit/", r - 1), kStoreCallTimeout));
              discarded = !absl::StartsWith(v, "1");
            }
          }
          // Which groups hold the state: members of round r - 1 all of whose ranks arrived as
          // members (not a new incarnation).
          d.max_step = step;
          std::vector<int> healthy;
          for (int g : d.groups) {
            bool all_members = true;
            for (int s = 0; s < o.group_size; ++s) {
              FS_ASSIGN_OR_RETURN(std::string v, store_->Get(ArriveKey(r, g, s), kStoreCallTimeout));
              const std::pair<absl::string_view, absl::string_view> fields =
                  absl::StrSplit(v, absl::MaxSplits(' ', 1));
              int64_t sv;
              if (absl::SimpleAtoi(fields.first, &sv)) d.max_step = std::max(d.max_step, sv);
              all_members = all_members && fields.second == "member";
            }
            if (r > 0 && Contains(prev.groups, g) && all_members) healthy.push_back(g);
          }
          if (r > 0) {
            for (int g : d.groups) {
              if (Contains(healthy, g)) continue;
              d.sources.push_back(healthy.empty() ? -1 : healthy[d.joiners.size() % healthy.size()]);
              d.joiners.push_back(g);
            }
          }
          // A new group set, a discarded step or a new incarnation: new communicators.
          d.epoch = r == 0 ? 0
                           : prev.epoch + (d.groups != prev.groups || discarded || !d.joiners.empty()
                                               ? 1 : 0);
          FS_RETURN_IF_ERROR(store_->CompareSet(RoundKey(r), "", Encode(d)).status());
          continue;  // read back whichever decision won
        }
      }
      if (absl::Now() >= deadline) {
        return absl::DeadlineExceededError(absl::StrCat(
            who, ": round ", r, " undecided after ", absl::FormatDuration(timeout),
            ": waiting for group(s) ", waiting_for, " (alive, not arrived)"));
      }
      absl::SleepFor(o.poll_interval);
    }
  }
}

absl::StatusOr<bool> Membership::should_commit(const Quorum& q, bool ok, absl::Duration timeout) {
  State& st = *state_;
  const Options& o = options_;
  const absl::Time deadline = absl::Now() + timeout;
  const std::string who = absl::StrCat("should_commit (round ", q.round, ", step ", q.step,
                                       ", group ", o.group, " rank ", o.shard, ")");
  const std::string verdict_key = absl::StrCat("commit/", q.round);
  auto vote_key = [&](int g, int s) { return VoteKey(q.round, g, s); };
  FS_RETURN_IF_ERROR(store_->Set(vote_key(o.group, o.shard), ok ? "1" : "0"));
  for (;;) {
    FS_RETURN_IF_ERROR(st.StoreHealth());
    FS_ASSIGN_OR_RETURN(bool decided, store_->Check(verdict_key));
    if (decided) {
      FS_ASSIGN_OR_RETURN(std::string v, store_->Get(verdict_key, kStoreCallTimeout));
      return absl::StartsWith(v, "1");
    }
    // Decidable: a vote "0", a rank of a group that died without voting, or every vote in.
    std::string verdict;
    std::string waiting_for;
    for (int g : q.groups) {
      bool group_dead_checked = false;
      std::string dead;
      for (int s = 0; s < o.group_size && verdict.empty(); ++s) {
        FS_ASSIGN_OR_RETURN(bool voted, store_->Check(vote_key(g, s)));
        if (voted) {
          FS_ASSIGN_OR_RETURN(std::string v, store_->Get(vote_key(g, s), kStoreCallTimeout));
          if (v != "1") verdict = absl::StrCat("0 group ", g, " rank ", s, " voted to discard");
          continue;
        }
        if (!group_dead_checked) {
          dead = st.FreshDeadReason(g);
          group_dead_checked = true;
        }
        if (!dead.empty()) {
          verdict = absl::StrCat("0 ", dead, " before voting");
        } else {
          absl::StrAppend(&waiting_for, waiting_for.empty() ? "" : ",", "(", g, ",", s, ")");
        }
      }
      if (!verdict.empty()) break;
    }
    if (verdict.empty() && waiting_for.empty()) verdict = "1";
    if (!verdict.empty()) {
      FS_RETURN_IF_ERROR(store_->CompareSet(verdict_key, "", verdict).status());
      continue;  // read back whichever verdict won
    }
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat(who, ": no verdict after ",
                                                      absl::FormatDuration(timeout),
                                                      ": waiting for the votes of rank(s) ",
                                                      waiting_for, " (alive)"));
    }
    absl::SleepFor(o.poll_interval);
  }
}

absl::StatusOr<std::shared_ptr<comm::Communicator>> Membership::replicate_communicator(
    const Quorum& q, std::shared_ptr<comm::Communicator> old, absl::string_view backend,
    const comm::CommConfig& base) const {
  comm::CommConfig config = base;
  config.name = absl::StrCat(base.name, "replicate/s", q.shard);
  config.rank = q.replicate_rank;
  config.size = q.replicate_size;
  absl::StatusOr<std::shared_ptr<comm::Communicator>> c =
      comm::ReplaceCommunicator(std::move(old), backend, config, q.epoch);
  if (!c.ok()) {
    return Annotate(c.status(), absl::StrCat("replicate communicator of round ", q.round, " epoch ",
                                             q.epoch, " (group ", q.group, " shard ", q.shard, ")"));
  }
  return c;
}

}  // namespace fairscale::ft
