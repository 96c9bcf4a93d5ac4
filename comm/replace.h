// Replacing a failed communicator inside a running process (//comm:replace): the foundation of
// in-process recovery (issue 25: the survivors of a dead rank, or a restarted replica group, go
// on without restarting their processes). Binaries and recovery layers use it, like registry.h;
// feature libraries keep taking a Communicator.
//
//   std::shared_ptr<Communicator> comm = ...;  // epoch 0
//   if (absl::Status s = comm->AllReduce(...).Wait(); !s.ok()) {
//     // The quorum layer decides the next epoch's members; each of them then calls:
//     CommConfig next = base;  // the same store, name and options
//     next.rank = new_rank;
//     next.size = new_size;
//     FS_ASSIGN_OR_RETURN(comm, ReplaceCommunicator(std::move(comm), "tcp", next, epoch + 1));
//   }
//
// Contract:
// * Epochs are a per-name sequence chosen by the caller (the quorum layer), the same on every
//   member of the new communicator. Members of epoch e rendezvous in the store namespace
//   EpochName(name, e) = "<name>/epoch<e>" (CommConfig::name, "" = "default"), so nothing of
//   an older epoch (published addresses, generation counters, heartbeats) is ever read by the
//   new one, and a rank that created more or fewer communicators than the others in the old
//   epoch (it failed half-way) still agrees with them on the new namespace.
// * Stale epochs are refused: the store keeps "fscomm/<name>/epoch", the highest epoch any rank
//   has started (raised atomically with CompareSet). A rank asking for an older epoch fails at
//   once with kFailedPrecondition naming both, instead of waiting out a rendezvous that nobody
//   else joins. (So a rank must not start epoch e + 1 before every member of epoch e has started
//   e: the quorum layer hands out epochs in order.) The tcp backend also refuses, in its
//   connection handshake, a connection meant for another communicator (see
//   comm/tcp/internal/mesh.h), so a late connect from an old epoch that reaches a reused port is
//   dropped and named, never joined.
// * The old communicator (may be null) is released before the new one is created; a broken one
//   as it is, a healthy one closed cleanly, as a finished communicator closes (peers waiting on
//   this rank then fail with kUnavailable naming it; those done with it never notice). It is
//   not aborted: an abort races with peers still completing their last operation (whose
//   messages from this rank are already sent) and fails it for them. To abort, call
//   comm->Abort(reason) first, or ReleaseCommunicator(comm, reason). Release is bounded
//   whatever the peers do (SIGKILLed, SIGSTOPped, wedged): the running operation is cancelled,
//   every Work has completed (with an error) before the call returns, so no buffer of an
//   aborted operation is touched again, the goodbye or error frames to the peers are written
//   without blocking (about 100 ms at most), the worker thread is joined and the sockets close.
//   The two heartbeat threads are detached and end within one heartbeat interval
//   (algo.heartbeat_ms; longer only while a store call hangs, and they hold nothing but the
//   store). Measured (comm/README.md): over 50 replacements threads and fds return exactly to
//   where they were, release takes milliseconds. When someone else still holds a reference, the
//   communicator lives on until its last holder drops it.
// * The new communicator is created as CreateCommunicator(backend, config) would, with
//   config.name changed as above: blocking, bounded by config.timeout.
// * Store keys: each epoch leaves a few keys per rank in its namespace (address, heartbeat
//   counter, generation counter), never read again; the store grows by that per epoch.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "comm/communicator.h"
#include "comm/config.h"

namespace fairscale::comm {

// The store namespace (CommConfig::name) of `name`'s epoch `epoch`: "<name>/epoch<epoch>",
// "default" for an empty name.
std::string EpochName(absl::string_view name, int64_t epoch);

// Drops this reference to `comm`, destroying it now when it was the last (bounded, see above);
// with a non-OK `reason`, aborts it first if it is still healthy, so that its peers fail at once
// with that reason. Null: no-op.
void ReleaseCommunicator(std::shared_ptr<Communicator> comm, absl::Status reason = {});

// Releases `failed` (may be null), then creates this rank's communicator of epoch `epoch` with
// backend `backend` ("" = highest priority linked) and config.rank / config.size as the new
// membership. kInvalidArgument for a negative epoch, or no store at size > 1;
// kFailedPrecondition when the store has seen a later epoch of config.name; else what
// CreateCommunicator returns.
absl::StatusOr<std::shared_ptr<Communicator>> ReplaceCommunicator(
    std::shared_ptr<Communicator> failed, absl::string_view backend, const CommConfig& config,
    int64_t epoch);

}  // namespace fairscale::comm
