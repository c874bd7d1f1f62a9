#include "kvbridge/model/tokenizer.h"

#include <gtest/gtest.h>

#include "kvbridge/model/config.h"

namespace kvbridge {
namespace {

TEST(Tokenizer, RoundTripsEveryByte) {
  Tokenizer tok(264, 256, 257, 258);
  std::string all;
  for (int b = 0; b < 256; ++b) all.push_back(static_cast<char>(b));
  all += "héllo wörld ✓ 日本";
  auto ids = *tok.Encode(all, /*add_special_tokens=*/true);
  ASSERT_EQ(ids.size(), all.size() + 1);
  EXPECT_EQ(ids[0], 256);
  EXPECT_EQ(ids[1], 0);
  EXPECT_EQ(ids[256], 255);
  EXPECT_EQ(tok.Decode(ids), all);
  EXPECT_EQ(*tok.Encode("ab", false), (std::vector<int32_t>{97, 98}));
}

TEST(Tokenizer, DecodeDropsSpecialAndInvalidIds) {
  Tokenizer tok(264, 256, 257, 258);
  EXPECT_EQ(tok.Decode(std::vector<int32_t>{256, 104, 257, 105, 258, -1, 263, 999}), "hi");
  EXPECT_TRUE(tok.IsSpecial(257));
  EXPECT_FALSE(tok.IsSpecial(255));
}

TEST(Tokenizer, StreamingHoldsBackIncompleteUtf8) {
  Tokenizer tok(264, 256, 257, 258);
  const std::string text =
      "a\xE2\x9C\x93"
      "b\xF0\x9F\x98";  // "a✓b" then 3 of 4 bytes of 😀
  IncrementalDecoder stream(tok, /*skip_special_tokens=*/true);
  std::vector<std::string> deltas;
  for (char c : text) deltas.push_back(stream.Push(static_cast<uint8_t>(c)));
  deltas.push_back(stream.Push(257));  // EOS renders as nothing
  EXPECT_EQ(deltas, (std::vector<std::string>{"a", "", "", "\xE2\x9C\x93", "b", "", "", "", ""}));
  EXPECT_EQ(stream.Finish(), "\xF0\x9F\x98");
  EXPECT_EQ(stream.Finish(), "");
}

TEST(Tokenizer, ParsesTokenIdPrompts) {
  Tokenizer tok(264, 256, 257, 258);
  auto ids = tok.ParseTokenIds("256, 1,2 3\n263");
  ASSERT_TRUE(ids.ok());
  EXPECT_EQ(*ids, (std::vector<int32_t>{256, 1, 2, 3, 263}));
  EXPECT_EQ(tok.ParseTokenIds("1,264").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(tok.ParseTokenIds("1,x").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(tok.ParseTokenIds("-3").status().code(), StatusCode::kInvalidArgument);
}

TEST(Tokenizer, ChatTemplate) {
  Tokenizer tok(264, 256, 257, 258);
  std::vector<ChatMessage> msgs = {{"system", "be brief"}, {"user", "hi"}};
  EXPECT_EQ(tok.ApplyChatTemplate(msgs, true),
            "<|system|>\nbe brief\n<|user|>\nhi\n<|assistant|>\n");
  EXPECT_EQ(tok.ApplyChatTemplate(msgs, false), "<|system|>\nbe brief\n<|user|>\nhi\n");
}

TEST(Tokenizer, ForConfigChecksSpecialIds) {
  ModelConfig c;
  c.vocab_size = 264;
  c.bos_token_id = 256;
  c.eos_token_ids = {257};
  c.pad_token_id = 258;
  auto t = Tokenizer::ForConfig(c);
  ASSERT_TRUE(t.ok());
  EXPECT_EQ(t->bos_id(), 256);
  EXPECT_EQ(t->eos_id(), 257);
  EXPECT_EQ(t->pad_id(), 258);
  c.bos_token_id = 1;  // a byte id cannot be special
  EXPECT_EQ(Tokenizer::ForConfig(c).status().code(), StatusCode::kInvalidArgument);
  c.bos_token_id = 256;
  c.vocab_size = 200;
  EXPECT_EQ(Tokenizer::ForConfig(c).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvbridge
