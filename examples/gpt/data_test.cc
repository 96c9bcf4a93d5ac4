#include "examples/gpt/data.h"

#include <algorithm>
#include <set>
#include <string>

#include "base/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace fairscale::examples::gpt {
namespace {

using ::fairscale::base::testing::StatusIs;
using ::testing::HasSubstr;

TEST(CorpusTest, IsTheEmbeddedKjvText) {
  absl::string_view text = Corpus();
  EXPECT_GT(text.size(), 300000u);
  EXPECT_LT(text.size(), 600000u);
  EXPECT_EQ(text.substr(0, 10), "Genesis 1\n");
  EXPECT_NE(text.find("In the beginning God created the heaven and the earth."),
            absl::string_view::npos);
  EXPECT_EQ(text.back(), '\n');
}

TEST(CharTokenizerTest, VocabularyIsTheSortedSetOfBytes) {
  CharTokenizer tok("banana!");
  EXPECT_EQ(tok.vocab_size(), 4);  // ! a b n
  ASSERT_OK_AND_ASSIGN(std::vector<int64_t> ids, tok.Encode("nab!"));
  EXPECT_EQ(ids, (std::vector<int64_t>{3, 1, 2, 0}));
  EXPECT_EQ(tok.Decode({2, 1, 3, 9, -1}), "ban??");
}

TEST(CharTokenizerTest, RoundTripsTheWholeCorpus) {
  CharTokenizer tok(Corpus());
  std::set<char> distinct(Corpus().begin(), Corpus().end());
  EXPECT_EQ(tok.vocab_size(), static_cast<int64_t>(distinct.size()));
  ASSERT_OK_AND_ASSIGN(std::vector<int64_t> ids, tok.Encode(Corpus()));
  ASSERT_EQ(ids.size(), Corpus().size());
  EXPECT_EQ(tok.Decode(ids), std::string(Corpus()));
}

TEST(CharTokenizerTest, UnknownByteIsAnErrorNamingIt) {
  CharTokenizer tok("abc");
  EXPECT_THAT(tok.Encode("abz").status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("byte 0x7a at offset 2")));
}

TEST(TokenDataTest, HoldsOutTheLastFivePercent) {
  CharTokenizer tok(Corpus());
  TokenData data(tok, Corpus());
  const auto& train = data.tokens(Split::kTrain);
  const auto& val = data.tokens(Split::kVal);
  EXPECT_EQ(train.size() + val.size(), Corpus().size());
  EXPECT_EQ(val.size(), static_cast<size_t>(Corpus().size() * 0.05));
  EXPECT_EQ(tok.Decode(val), std::string(Corpus().substr(train.size())));
}

bool IsWindowOf(const std::vector<int64_t>& src, const int64_t* row, int64_t n) {
  return std::search(src.begin(), src.end(), row, row + n) != src.end();
}

TEST(TokenDataTest, BatchIsAPureFunctionOfSeedStepRankSplit) {
  CharTokenizer tok(Corpus());
  TokenData data(tok, Corpus());
  const int64_t batch = 4, seq = 32;
  const std::vector<int64_t> a = data.Batch(7, 12, 1, Split::kTrain, batch, seq);
  ASSERT_EQ(a.size(), static_cast<size_t>(batch * (seq + 1)));
  // Same arguments, a fresh TokenData: the same batch.
  TokenData again(tok, Corpus());
  EXPECT_EQ(again.Batch(7, 12, 1, Split::kTrain, batch, seq), a);
  // Any other argument changes it.
  EXPECT_NE(data.Batch(8, 12, 1, Split::kTrain, batch, seq), a);
  EXPECT_NE(data.Batch(7, 13, 1, Split::kTrain, batch, seq), a);
  EXPECT_NE(data.Batch(7, 12, 0, Split::kTrain, batch, seq), a);
  EXPECT_NE(data.Batch(7, 12, 1, Split::kVal, batch, seq), a);
  // Each row is seq + 1 consecutive tokens of its split.
  const std::vector<int64_t> v = data.Batch(7, 12, 1, Split::kVal, batch, seq);
  for (int64_t r = 0; r < batch; ++r) {
    EXPECT_TRUE(IsWindowOf(data.tokens(Split::kTrain), a.data() + r * (seq + 1), seq + 1)) << r;
    EXPECT_TRUE(IsWindowOf(data.tokens(Split::kVal), v.data() + r * (seq + 1), seq + 1)) << r;
  }
}

TEST(TokenDataTest, BatchStartsCoverTheSplit) {
  // Over many steps the windows start all over the split, not in one region.
  CharTokenizer tok(Corpus());
  TokenData data(tok, "abcdefghij");
  std::set<int64_t> firsts;
  for (int step = 0; step < 200; ++step) {
    firsts.insert(data.Batch(1, step, 0, Split::kTrain, 1, 2)[0]);
  }
  // 10 * 0.95 -> 10 train tokens, 8 possible starts of a 3-token window.
  EXPECT_EQ(firsts.size(), 8u);
}

TEST(TokenDataTest, TooShortSplitThrows) {
  CharTokenizer tok("abc");
  TokenData data(tok, "abc");
  EXPECT_THROW(data.Batch(1, 1, 0, Split::kVal, 1, 2), std::invalid_argument);
}

}  // namespace
}  // namespace fairscale::examples::gpt
