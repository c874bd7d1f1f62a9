// kvbridge/server/tokenizer_codec.h — the model's byte-level Tokenizer as the server's TextCodec.
//
//   auto codec = std::make_shared<server::TokenizerCodec>(model->tokenizer());
//   ASSIGN_OR_RETURN(auto srv, server::ApiServer::Create(cfg, engine.get(), codec));
//
// Prompts get BOS when the model has one; Decode drops special tokens (EOS renders as nothing);
// the chat template is Tokenizer::ApplyChatTemplate with the assistant cue.
// Thread-safety: immutable; safe to share.
#pragma once

#include "kvbridge/model/tokenizer.h"
#include "kvbridge/server/api_server.h"

namespace kvbridge::server {

class TokenizerCodec : public TextCodec {
 public:
  explicit TokenizerCodec(Tokenizer tokenizer) : tok_(std::move(tokenizer)) {}
  std::vector<int32_t> Encode(std::string_view text) const override;
  std::string Decode(std::span<const int32_t> ids) const override;
  int32_t vocab_size() const override { return tok_.vocab_size(); }
  std::string ApplyChatTemplate(const std::vector<ChatMessage>& messages) const override;

 private:
  Tokenizer tok_;
};

}  // namespace kvbridge::server
