// The Hugging Face tokenizer.json kind: to be implemented (issue 16).
#include "model/tokenizer_backend.h"

namespace kvbridge::model_internal {

Result<std::shared_ptr<const TokenizerBackend>> MakeHuggingFaceBackend(std::string_view,
                                                                       std::string_view,
                                                                       std::string_view source) {
  return UnimplementedError(std::string(source) +
                            ": Hugging Face tokenizer.json is not supported yet");
}

}  // namespace kvbridge::model_internal
