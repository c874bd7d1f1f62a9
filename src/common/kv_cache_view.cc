#include "kvbridge/common/kv_cache_view.h"

namespace kvbridge {

std::string_view KvDtypeName(KvDtype d) {
  switch (d) {
    case KvDtype::kFp32:
      return "fp32";
    case KvDtype::kBf16:
      return "bf16";
    case KvDtype::kFp8E4M3:
      return "fp8";
  }
  return "unknown";
}

}  // namespace kvbridge
