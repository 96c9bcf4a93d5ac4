// Fuzz target for the TCPStore frame decoder (comm/store/wire.h). Built two ways:
// //comm/store/fuzz:wire_fuzz_test (gcc; replays the seed corpus plus deterministic mutations
// in CI) and run_libfuzzer.sh (clang, -fsanitize=fuzzer,address,undefined).
//
// For each input, in both directions and in two chunkings, it checks that the decoder
//   * returns OK or kInvalidArgument, and stays broken (same error) after an error;
//   * accounts for every byte: consumed() + buffered() == input size while OK;
//   * decodes the same messages and the same verdict whatever the chunking;
//   * decodes only canonical frames: re-encoding the messages gives back exactly the bytes
//     consumed;
// and that a server's decoder behind the hello gate (RequireHello) yields at most the leading
// hello, buffers at most one hello frame's worth for a frame in progress, refuses any other
// first frame at its header, and after Admit() decodes exactly what an ungated decoder does.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "base/fuzz_check.h"
#include "comm/store/wire.h"

namespace {

using fairscale::comm::wire::Decoder;
using fairscale::comm::wire::Message;

struct Result {
  absl::Status status;
  std::vector<Message> messages;
  uint64_t consumed = 0;
};

// Feeds `input` in pieces whose sizes cycle through `chunks` (0 = everything at once).
Result Decode(Decoder::Direction direction, absl::string_view input,
              const std::vector<size_t>& chunks) {
  Decoder decoder(direction);
  Result r;
  size_t pos = 0;
  size_t i = 0;
  while (pos < input.size()) {
    size_t n = chunks.empty() ? input.size() : chunks[i++ % chunks.size()];
    if (n == 0 || n > input.size() - pos) n = input.size() - pos;
    r.status = decoder.Feed(input.substr(pos, n), &r.messages);
    pos += n;
    if (!r.status.ok()) break;
    FS_FUZZ_CHECK(decoder.consumed() + decoder.buffered() == pos);
  }
  if (!r.status.ok()) {
    FS_FUZZ_CHECK(r.status.code() == absl::StatusCode::kInvalidArgument);
    // Broken for good, with the same error.
    std::vector<Message> more;
    FS_FUZZ_CHECK(decoder.Feed(input.substr(0, 1), &more) == r.status);
    FS_FUZZ_CHECK(more.empty());
    FS_FUZZ_CHECK(decoder.buffered() == 0);
  }
  r.consumed = decoder.consumed();
  return r;
}

Result CheckDirection(Decoder::Direction direction, absl::string_view input) {
  const Result whole = Decode(direction, input, {});
  // Chunk sizes derived from the input, so a crash reproduces from the input alone.
  std::vector<size_t> chunks = {1, 7, 24, 3};
  if (!input.empty()) chunks.push_back(static_cast<uint8_t>(input[0]) % 64 + 1);
  const Result pieces = Decode(direction, input, chunks);

  FS_FUZZ_CHECK(whole.status == pieces.status);
  FS_FUZZ_CHECK(whole.messages == pieces.messages);
  FS_FUZZ_CHECK(whole.consumed == pieces.consumed);

  std::string encoded;
  for (const Message& m : whole.messages) {
    FS_FUZZ_CHECK(fairscale::comm::wire::Encode(m, &encoded).ok());
  }
  FS_FUZZ_CHECK(encoded.size() == whole.consumed);
  FS_FUZZ_CHECK(absl::string_view(encoded) == input.substr(0, whole.consumed));
  return whole;
}

// `ungated`: the same input through a request decoder without the gate.
void CheckHelloGate(absl::string_view input, const Result& ungated) {
  using fairscale::comm::wire::WireCommand;
  Decoder d(Decoder::Direction::kRequests);
  d.RequireHello();
  std::vector<Message> got;
  absl::Status s = d.Feed(input, &got);
  FS_FUZZ_CHECK(d.partial_frame_bytes() <= fairscale::comm::wire::kMaxHelloFrameBytes);
  FS_FUZZ_CHECK(got.size() <= 1);
  if (!got.empty()) {
    FS_FUZZ_CHECK(s.ok());
    FS_FUZZ_CHECK(got[0].command == WireCommand::kHello);
    FS_FUZZ_CHECK(!ungated.messages.empty() && ungated.messages[0] == got[0]);
    FS_FUZZ_CHECK(d.gated());
    d.Admit();
    s = d.Feed(absl::string_view(), &got);
    FS_FUZZ_CHECK(s == ungated.status);
    FS_FUZZ_CHECK(got == ungated.messages);
  } else if (!s.ok()) {
    FS_FUZZ_CHECK(s.code() == absl::StatusCode::kInvalidArgument);
    FS_FUZZ_CHECK(d.buffered() == 0);
    FS_FUZZ_CHECK(ungated.messages.empty() ||
                  ungated.messages[0].command != WireCommand::kHello);
  } else {
    // The first frame is still incomplete: held whole, as the ungated decoder holds it.
    FS_FUZZ_CHECK(ungated.messages.empty());
    FS_FUZZ_CHECK(d.buffered() == input.size());
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const absl::string_view input(reinterpret_cast<const char*>(data), size);
  const Result requests = CheckDirection(Decoder::Direction::kRequests, input);
  CheckHelloGate(input, requests);
  CheckDirection(Decoder::Direction::kReplies, input);
  return 0;
}
