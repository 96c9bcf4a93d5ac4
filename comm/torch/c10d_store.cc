#include "comm/torch/c10d_store.h"

#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/csrc/distributed/c10d/exception.h>

#include <algorithm>
#include <chrono>
#include <exception>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "c10/util/Exception.h"

namespace fairscale::comm {
namespace {

// A present key is still returned by Get(key, 0): c10d needs a non-zero socket timeout.
constexpr absl::Duration kMinTimeout = absl::Milliseconds(50);

std::chrono::milliseconds Millis(absl::Duration d) {
  return std::chrono::milliseconds(absl::ToInt64Milliseconds(std::max(d, kMinTimeout)));
}

std::vector<uint8_t> Bytes(absl::string_view s) { return std::vector<uint8_t>(s.begin(), s.end()); }

std::string Str(const std::vector<uint8_t>& v) { return std::string(v.begin(), v.end()); }

bool LooksLikeTimeout(absl::string_view what) {
  return absl::StrContains(what, "imeout") || absl::StrContains(what, "timed out") ||
         absl::StrContains(what, "Resource temporarily unavailable");
}

// What an exception of c10d's client (c10d::TimeoutError, c10::Error, std::exception) says,
// and whether it reports a timeout. Call only inside a catch block.
struct Failure {
  bool timed_out = false;
  std::string what;
};
Failure CurrentFailure() {
  try {
    throw;
  } catch (const c10d::TimeoutError& e) {
    return {true, e.what()};
  } catch (const c10::Error& e) {
    std::string what = e.what_without_backtrace();
    return {LooksLikeTimeout(what), what};
  } catch (const std::exception& e) {
    return {LooksLikeTimeout(e.what()), e.what()};
  }
}

class C10dStoreClient : public Store {
 public:
  explicit C10dStoreClient(StoreClientOptions options) : options_(std::move(options)) {}

  // Connects and checks that the server answers.
  absl::Status Connect() {
    absl::MutexLock lock(&mu_);
    return EnsureConnected("connect");
  }

  absl::Status Set(absl::string_view key, absl::string_view value) override {
    return Call("set", key, options_.timeout, [&](c10d::TCPStore& s) {
      s.set(std::string(key), Bytes(value));
    });
  }

  absl::StatusOr<std::string> Get(absl::string_view key, absl::Duration timeout) override {
    std::string out;
    absl::Status st = Call("get", key, timeout, [&](c10d::TCPStore& s) {
      s.setTimeout(Millis(timeout));  // get() waits for the key for the store's timeout
      out = Str(s.get(std::string(key)));
    });
    if (!st.ok()) return st;
    return out;
  }

  absl::StatusOr<int64_t> Add(absl::string_view key, int64_t delta) override {
    int64_t out = 0;
    absl::Status st = Call("add", key, options_.timeout,
                           [&](c10d::TCPStore& s) { out = s.add(std::string(key), delta); });
    if (!st.ok()) return st;
    return out;
  }

  absl::StatusOr<std::string> CompareSet(absl::string_view key, absl::string_view expected,
                                         absl::string_view desired) override {
    std::string out;
    absl::Status st = Call("compare_set", key, options_.timeout, [&](c10d::TCPStore& s) {
      out = Str(s.compareSet(std::string(key), Bytes(expected), Bytes(desired)));
    });
    if (!st.ok()) return st;
    // c10d answers `expected` when the key is missing and `expected` is not empty; the swap
    // happened only if the answer is `desired`, and a present key equal to `expected` would
    // have been swapped, so that answer means "missing".
    if (out == expected && expected != desired) return std::string();
    return out;
  }

  absl::StatusOr<bool> Delete(absl::string_view key) override {
    bool out = false;
    absl::Status st = Call("delete", key, options_.timeout,
                           [&](c10d::TCPStore& s) { out = s.deleteKey(std::string(key)); });
    if (!st.ok()) return st;
    return out;
  }

  absl::Status Wait(absl::Span<const std::string> keys, absl::Duration timeout) override {
    return Call("wait", absl::StrJoin(keys, ", "), timeout, [&](c10d::TCPStore& s) {
      s.wait(std::vector<std::string>(keys.begin(), keys.end()), Millis(timeout));
    });
  }

  absl::StatusOr<bool> Check(absl::string_view key) override {
    bool out = false;
    absl::Status st = Call("check", key, options_.timeout,
                           [&](c10d::TCPStore& s) { out = s.check({std::string(key)}); });
    if (!st.ok()) return st;
    return out;
  }

 private:
  std::string Where() const {
    return absl::StrCat("c10d TCPStore ", options_.host, ":", options_.port);
  }

  absl::Status Error(absl::string_view op, absl::string_view key, absl::Duration timeout,
                     bool timed_out, absl::string_view what) const {
    std::string msg = absl::StrCat(Where(), ": ", op, key.empty() ? "" : " '", key,
                                   key.empty() ? "" : "'");
    if (timed_out) {
      return absl::DeadlineExceededError(absl::StrCat(
          msg, ": no answer within ", absl::FormatDuration(std::max(timeout, kMinTimeout)),
          " (", what, ")"));
    }
    return absl::UnavailableError(absl::StrCat(msg, ": ", what));
  }

  // Runs f, turning c10d's exceptions into a Status. The socket timeout is `timeout`.
  template <typename F>
  absl::Status Call(absl::string_view op, absl::string_view key, absl::Duration timeout, F f) {
    absl::MutexLock lock(&mu_);
    if (absl::Status s = EnsureConnected(op); !s.ok()) return s;
    Failure failure;
    try {
      if (socket_timeout_ != timeout && op != "get" && op != "wait") {
        // Only wait() sets the socket's timeout: an empty one (one round trip) re-arms it.
        store_->wait({}, Millis(timeout));
        socket_timeout_ = timeout;
      } else if (op == "get" || op == "wait") {
        socket_timeout_ = timeout;
      }
      f(*store_);
      return absl::OkStatus();
    } catch (const std::exception&) {
      failure = CurrentFailure();
    }
    // Replies may now be out of step with requests: the next call reconnects.
    store_.reset();
    return Error(op, key, timeout, failure.timed_out, failure.what);
  }

  absl::Status EnsureConnected(absl::string_view op) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (store_ != nullptr) return absl::OkStatus();
    c10d::TCPStoreOptions o;
    o.port = static_cast<std::uint16_t>(options_.port);
    o.isServer = false;
    o.waitWorkers = false;
    o.timeout = Millis(options_.timeout);
    Failure failure;
    try {
      auto store = std::make_unique<c10d::TCPStore>(options_.host, o);
      // c10d's client sends nothing on connect: an empty wait checks that a server answers
      // and gives the socket a receive timeout.
      store->wait({}, Millis(options_.timeout));
      socket_timeout_ = options_.timeout;
      store_ = std::move(store);
      return absl::OkStatus();
    } catch (const std::exception&) {
      failure = CurrentFailure();
    }
    return Error(op == "connect" ? "connect" : absl::StrCat("connect (for ", op, ")"), "",
                 options_.timeout, failure.timed_out, failure.what);
  }

  const StoreClientOptions options_;
  absl::Mutex mu_;
  std::unique_ptr<c10d::TCPStore> store_ ABSL_GUARDED_BY(mu_);
  absl::Duration socket_timeout_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

absl::StatusOr<std::unique_ptr<Store>> CreateC10dStoreClient(const StoreClientOptions& options) {
  if (options.host.empty()) return absl::InvalidArgumentError("c10d TCPStore: empty host");
  if (options.port < 1 || options.port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("c10d TCPStore ", options.host, ":", options.port, ": bad port"));
  }
  auto client = std::make_unique<C10dStoreClient>(options);
  if (absl::Status s = client->Connect(); !s.ok()) return s;
  return std::unique_ptr<Store>(std::move(client));
}

namespace {
const StoreClientRegistration kRegistration("c10d", &CreateC10dStoreClient);
}  // namespace

}  // namespace fairscale::comm
