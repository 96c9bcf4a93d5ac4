// The TCPStore frame format: round trips in any chunking, and rejection of malformed or hostile
// frames before their body is buffered.
#include "comm/store/wire.h"

#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_matchers.h"
#include "comm/store/store.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace fairscale::comm::wire {
namespace {

using ::fairscale::base::testing::IsOk;
using ::fairscale::base::testing::StatusIs;
using ::testing::HasSubstr;
using ::testing::SizeIs;

using Direction = Decoder::Direction;

std::string Header(uint8_t command, uint32_t id, uint32_t key_len, uint64_t value_len) {
  std::string h(kWireMagic, 4);
  h.push_back(static_cast<char>(kWireVersion));
  h.push_back(static_cast<char>(command));
  h.append(2, '\0');
  for (int i = 0; i < 4; ++i) h.push_back(static_cast<char>(id >> (8 * i)));
  for (int i = 0; i < 4; ++i) h.push_back(static_cast<char>(key_len >> (8 * i)));
  for (int i = 0; i < 8; ++i) h.push_back(static_cast<char>(value_len >> (8 * i)));
  return h;
}

std::string AllRequests() {
  std::string s;
  EXPECT_OK(EncodeSet(1, "key/1", std::string("v\0v", 3), &s));
  EXPECT_OK(EncodeGet(2, "k", absl::Milliseconds(1500), &s));
  EXPECT_OK(EncodeAdd(3, "counter", -42, &s));
  EXPECT_OK(EncodeCompareSet(4, "cas", "", "desired", &s));
  EXPECT_OK(EncodeDelete(5, "d", &s));
  EXPECT_OK(EncodeCheck(6, "c", &s));
  EXPECT_OK(EncodeWait(7, {"a", "bb", "ccc"}, absl::InfiniteDuration(), &s));
  return s;
}

std::string AllReplies() {
  std::string s;
  EncodeOk(1, &s);
  EncodeValue(2, "value", &s);
  EncodeInt(3, INT64_MIN, &s);
  EncodeBool(4, true, &s);
  EncodeError(5, absl::NotFoundError("gone"), &s);
  return s;
}

TEST(Wire, HeaderIs24Bytes) {
  std::string s;
  ASSERT_OK(EncodeDelete(7, "abc", &s));
  EXPECT_EQ(s.size(), kHeaderBytes + 3);
  EXPECT_EQ(s.substr(0, 4), "FSST");
}

TEST(Wire, RequestsRoundTripInEveryChunkSize) {
  const std::string bytes = AllRequests();
  for (size_t chunk : {size_t{1}, size_t{3}, size_t{24}, size_t{25}, bytes.size()}) {
    Decoder d(Direction::kRequests);
    std::vector<Message> out;
    for (size_t i = 0; i < bytes.size(); i += chunk) {
      ASSERT_OK(d.Feed(absl::string_view(bytes).substr(i, chunk), &out));
    }
    ASSERT_THAT(out, SizeIs(7)) << "chunk " << chunk;
    EXPECT_EQ(d.buffered(), 0u);
    EXPECT_EQ(d.consumed(), bytes.size());
    EXPECT_EQ(out[0].command, WireCommand::kSet);
    EXPECT_EQ(out[0].key, "key/1");
    EXPECT_EQ(out[0].value, std::string("v\0v", 3));
    EXPECT_EQ(out[1].number, 1500);
    EXPECT_EQ(out[2].number, -42);
    EXPECT_EQ(out[3].expected, "");
    EXPECT_EQ(out[3].value, "desired");
    EXPECT_EQ(out[6].keys, (std::vector<std::string>{"a", "bb", "ccc"}));
    std::string again;
    for (const Message& m : out) ASSERT_OK(Encode(m, &again));
    EXPECT_EQ(again, bytes);
  }
}

TEST(Wire, HelloCarriesTheTokenAndRoundTrips) {
  std::string s;
  ASSERT_OK(EncodeHello(9, "0123abcd", &s));
  ASSERT_OK(EncodeHello(10, "", &s));
  Decoder d(Direction::kRequests);
  std::vector<Message> out;
  ASSERT_OK(d.Feed(s, &out));
  ASSERT_THAT(out, SizeIs(2));
  EXPECT_EQ(out[0].command, WireCommand::kHello);
  EXPECT_EQ(out[0].request_id, 9u);
  EXPECT_EQ(out[0].value, "0123abcd");
  EXPECT_EQ(out[1].value, "");
  std::string again;
  for (const Message& m : out) ASSERT_OK(Encode(m, &again));
  EXPECT_EQ(again, s);
  // A hello is a request: a client decoding replies rejects it.
  Decoder client(Direction::kReplies);
  EXPECT_THAT(client.Feed(s, &out), StatusIs(absl::StatusCode::kInvalidArgument));
  std::string too_long;
  EXPECT_THAT(EncodeHello(1, std::string(kMaxTokenBytes + 1, 'x'), &too_long),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_TRUE(too_long.empty());
}

TEST(Wire, RepliesRoundTrip) {
  const std::string bytes = AllReplies();
  Decoder d(Direction::kReplies);
  std::vector<Message> out;
  ASSERT_OK(d.Feed(bytes, &out));
  ASSERT_THAT(out, SizeIs(5));
  EXPECT_EQ(out[2].number, INT64_MIN);
  EXPECT_EQ(out[3].number, 1);
  EXPECT_THAT(ErrorStatus(out[4]), StatusIs(absl::StatusCode::kNotFound, "gone"));
  std::string again;
  for (const Message& m : out) ASSERT_OK(Encode(m, &again));
  EXPECT_EQ(again, bytes);
}

TEST(Wire, EncodersEnforceTheStoreLimits) {
  std::string s;
  EXPECT_THAT(EncodeSet(1, std::string(kMaxStoreKeyBytes + 1, 'k'), "v", &s),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(EncodeGet(1, "", absl::Seconds(1), &s),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(EncodeWait(1, {"a", ""}, absl::Seconds(1), &s),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_TRUE(s.empty());
}

TEST(Wire, DirectionIsEnforced) {
  Decoder server(Direction::kRequests);
  std::vector<Message> out;
  EXPECT_THAT(server.Feed(AllReplies(), &out),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not a request")));
  Decoder client(Direction::kReplies);
  EXPECT_THAT(client.Feed(AllRequests(), &out),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not a reply")));
}

TEST(Wire, HostileLengthIsRejectedFromTheHeaderAlone) {
  Decoder d(Direction::kRequests);
  std::vector<Message> out;
  const std::string h = Header(1, 9, 1, uint64_t{1} << 60);
  EXPECT_THAT(d.Feed(h, &out), StatusIs(absl::StatusCode::kInvalidArgument,
                                        HasSubstr("value length 1152921504606846976")));
  EXPECT_EQ(d.buffered(), 0u);
  // The error is sticky.
  EXPECT_THAT(d.Feed(AllRequests(), &out), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_TRUE(out.empty());
}

TEST(Wire, MalformedFramesAreInvalidArgument) {
  struct Case {
    std::string name;
    std::string bytes;
    std::string message;
  };
  std::string bad_reserved = Header(5, 1, 1, 0) + "k";
  bad_reserved[6] = 1;
  std::string bad_version = Header(5, 1, 1, 0) + "k";
  bad_version[4] = 2;
  std::string compare_set = Header(4, 1, 1, 8) + "k";
  compare_set += std::string("\x09\0\0\0\0\0\0\0", 8);  // expected_len 9 > 0 bytes left
  std::string wait_count = Header(7, 1, 0, 12);
  wait_count += std::string(8, '\0') + std::string("\xff\xff\xff\xff", 4);
  std::string wait_trailing = Header(7, 1, 0, 13);
  wait_trailing += std::string(8, '\0') + std::string(4, '\0') + "x";
  std::string negative_timeout = Header(2, 1, 1, 8) + "k" + std::string(8, '\xff');
  const std::vector<Case> cases = {
      {"garbage", "GET / HTTP/1.1\r\nHost: x\r\n\r\n", "bad magic"},
      {"unknown command", Header(99, 1, 0, 0), "unknown command 99"},
      {"reserved", bad_reserved, "reserved"},
      {"version", bad_version, "version 2"},
      {"empty key", Header(1, 1, 0, 0), "empty key"},
      {"long key", Header(1, 1, kMaxStoreKeyBytes + 1, 0), "key length 4097"},
      {"big value", Header(1, 1, 1, kMaxStoreValueBytes + 1), "value length"},
      {"get length", Header(2, 1, 1, 7), "value length 7"},
      {"delete value", Header(5, 1, 1, 1), "value length 1"},
      {"wait key", Header(7, 1, 3, 12), "carries a key"},
      {"compare_set", compare_set, "expected length 9"},
      {"wait count", wait_count, "4294967295 keys"},
      {"wait trailing", wait_trailing, "trailing"},
      {"negative timeout", negative_timeout, "negative timeout"},
  };
  for (const Case& c : cases) {
    Decoder d(Direction::kRequests);
    std::vector<Message> out;
    EXPECT_THAT(d.Feed(c.bytes, &out),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(c.message)))
        << c.name;
    EXPECT_TRUE(out.empty()) << c.name;
  }

  std::string bad_bool = Header(67, 1, 0, 1) + "\x02";
  std::string bad_code = Header(68, 1, 0, 1) + std::string(1, '\0');
  for (const std::string& bytes : {bad_bool, bad_code}) {
    Decoder d(Direction::kReplies);
    std::vector<Message> out;
    EXPECT_THAT(d.Feed(bytes, &out), StatusIs(absl::StatusCode::kInvalidArgument));
  }
}

TEST(Wire, FramesBeforeABadOneAreStillDelivered) {
  std::string bytes;
  ASSERT_OK(EncodeCheck(1, "first", &bytes));
  bytes += "garbage that is at least twenty-four bytes";
  Decoder d(Direction::kRequests);
  std::vector<Message> out;
  EXPECT_THAT(d.Feed(bytes, &out), StatusIs(absl::StatusCode::kInvalidArgument,
                                            HasSubstr(absl::StrCat("offset ", kHeaderBytes + 5))));
  ASSERT_THAT(out, SizeIs(1));
  EXPECT_EQ(out[0].key, "first");
}

TEST(Wire, PartialFrameWaitsForMoreBytes) {
  std::string bytes;
  ASSERT_OK(EncodeSet(1, "k", std::string(1000, 'v'), &bytes));
  Decoder d(Direction::kRequests);
  std::vector<Message> out;
  ASSERT_OK(d.Feed(absl::string_view(bytes).substr(0, 500), &out));
  EXPECT_TRUE(out.empty());
  EXPECT_EQ(d.buffered(), 500u);
  ASSERT_OK(d.Feed(absl::string_view(bytes).substr(500), &out));
  ASSERT_THAT(out, SizeIs(1));
  EXPECT_EQ(out[0].value, std::string(1000, 'v'));
}

TEST(Wire, ErrorMessagesAreCut) {
  std::string bytes;
  EncodeError(1, absl::InternalError(std::string(kMaxErrorMessageBytes + 100, 'e')), &bytes);
  Decoder d(Direction::kReplies);
  std::vector<Message> out;
  ASSERT_OK(d.Feed(bytes, &out));
  ASSERT_THAT(out, SizeIs(1));
  EXPECT_EQ(out[0].value.size(), kMaxErrorMessageBytes);
}


// ---- the hello gate (servers with a job token) --------------------------------------------

TEST(DecoderGate, AnythingButAHelloIsRejectedAtItsHeader) {
  Decoder d(Direction::kRequests);
  d.RequireHello();
  EXPECT_TRUE(d.gated());
  std::vector<Message> out;
  // A Set announcing 60 MiB: refused on its 24 header bytes, nothing kept.
  EXPECT_THAT(d.Feed(Header(1, 77, 1, 60 << 20), &out),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "store wire: malformed frame at stream offset 0: set before the hello "
                       "(the job token comes first)"));
  EXPECT_THAT(out, SizeIs(0));
  EXPECT_EQ(d.buffered(), 0u);
  EXPECT_EQ(d.partial_frame_bytes(), 0u);
  EXPECT_EQ(d.current_request_id(), 77u);
}

TEST(DecoderGate, AHelloOverTheTokenLimitIsRejectedAtItsHeader) {
  Decoder d(Direction::kRequests);
  d.RequireHello();
  std::vector<Message> out;
  EXPECT_THAT(d.Feed(Header(8, 1, 0, kMaxTokenBytes + 1), &out),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("hello value length 1025")));
  EXPECT_EQ(kMaxHelloFrameBytes, 24u + 1024u);
}

TEST(DecoderGate, FramesBehindTheHelloWaitForAdmit) {
  Decoder d(Direction::kRequests);
  d.RequireHello();
  std::string stream;
  ASSERT_OK(EncodeHello(3, "token", &stream));
  const size_t hello_bytes = stream.size();
  ASSERT_OK(EncodeSet(4, "k", "v", &stream));
  std::vector<Message> out;
  ASSERT_OK(d.Feed(stream, &out));
  ASSERT_THAT(out, SizeIs(1));
  EXPECT_EQ(out[0].command, WireCommand::kHello);
  EXPECT_EQ(out[0].value, "token");
  // The set is held, undecoded, even though it is complete.
  EXPECT_EQ(d.buffered(), stream.size() - hello_bytes);
  EXPECT_TRUE(d.gated());
  d.Admit();
  EXPECT_FALSE(d.gated());
  out.clear();
  ASSERT_OK(d.Feed("", &out));
  ASSERT_THAT(out, SizeIs(1));
  EXPECT_EQ(out[0].command, WireCommand::kSet);
  EXPECT_EQ(out[0].request_id, 4u);
  EXPECT_EQ(d.buffered(), 0u);
}

TEST(Decoder, PartialFrameBytesIsTheAnnouncedSizeOnceTheHeaderIsIn) {
  Decoder d(Direction::kRequests);
  std::string frame;
  ASSERT_OK(EncodeSet(9, "key", std::string(1000, 'x'), &frame));
  std::vector<Message> out;
  ASSERT_OK(d.Feed(frame.substr(0, 23), &out));
  EXPECT_EQ(d.partial_frame_bytes(), 0u);  // The header is not complete yet.
  ASSERT_OK(d.Feed(frame.substr(23, 100), &out));
  EXPECT_EQ(d.partial_frame_bytes(), 24u + 3u + 1000u);
  EXPECT_EQ(d.current_request_id(), 9u);
  ASSERT_OK(d.Feed(frame.substr(123), &out));
  EXPECT_EQ(d.partial_frame_bytes(), 0u);
  EXPECT_THAT(out, SizeIs(1));
}

}  // namespace
}  // namespace fairscale::comm::wire
