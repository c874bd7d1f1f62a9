// kvbridge/model/safetensors.h — our own reader/writer of the safetensors format.
//
// Format (https://github.com/huggingface/safetensors): 8 bytes little-endian u64 N, then N bytes
// of JSON `{"__metadata__": {str: str}, "<name>": {"dtype": "BF16", "shape": [..],
// "data_offsets": [begin, end]}, ...}`, then the data; offsets are relative to the data start.
// Every check is done on parse: header size, JSON shape, known dtype, offsets inside the data,
// `end - begin == prod(shape) * dtype size` (overflow-checked), no overlapping tensors.
// Malformed input gives InvalidArgument / DataLoss naming the file — never a crash (fuzzed).
//
// Files are memory-mapped read-only (MAP_PRIVATE, unmapped when the last copy of the
// SafetensorsFile / TensorStore holding them dies), so a tensor's bytes can be used in place.
//
//   ASSIGN_OR_RETURN(auto store, TensorStore::OpenDir(model_dir));   // single file or shards
//   ASSIGN_OR_RETURN(std::vector<float> w, store.ReadFloat32("model.norm.weight", {hidden}));
//   ASSIGN_OR_RETURN(TensorBytes t, store.Bytes("model.embed_tokens.weight", {vocab, hidden}));
//
// Thread-safety: SafetensorsFile and TensorStore are immutable after opening; const methods
// may be called concurrently.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvbridge/common/status.h"

namespace kvbridge {

struct TensorInfo {
  std::string name;
  std::string dtype;           ///< as in the header: "F32", "BF16", "F16", "F64", "I32", ...
  std::vector<int64_t> shape;  ///< may be empty (a scalar)
  uint64_t begin = 0;          ///< byte offset into the data section
  uint64_t end = 0;
};

/// Element size of a safetensors dtype name, or 0 when unknown.
size_t SafetensorsDtypeSize(std::string_view dtype);

/// A float tensor's raw bytes in place (valid while the file or store it came from lives).
struct TensorBytes {
  std::string dtype;  ///< "F32", "BF16", "F16" or "F64"
  std::vector<int64_t> shape;
  std::string_view data;  ///< prod(shape) little-endian elements of dtype
};

/// One parsed .safetensors file: memory-mapped (Open) or held in memory (Parse). Copies share
/// the bytes.
class SafetensorsFile {
 public:
  /// Maps and parses `path`. NotFound when unreadable; InvalidArgument / DataLoss when
  /// malformed. Messages start with the file name.
  static Result<SafetensorsFile> Open(const std::string& path);
  /// Parses bytes already in memory; `display_name` names the file in error messages.
  static Result<SafetensorsFile> Parse(std::string bytes, std::string display_name);

  const std::string& name() const { return name_; }
  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  /// nullptr when absent.
  const TensorInfo* Find(std::string_view tensor) const;
  /// The raw bytes of `info` (a tensor of this file).
  std::string_view Data(const TensorInfo& info) const;
  /// The tensor converted to fp32 (from F32, F16, BF16, F64). InvalidArgument, naming the
  /// file and tensor, when absent, of another dtype, or when `expected_shape` (if given)
  /// differs: "model.safetensors: tensor 'x': expected shape [64,64], found [64,32]".
  Result<std::vector<float>> ReadFloat32(std::string_view tensor,
                                         std::span<const int64_t> expected_shape) const;
  /// The tensor's bytes in place, after the same checks as ReadFloat32 (same errors).
  Result<TensorBytes> Bytes(std::string_view tensor, std::span<const int64_t> expected_shape) const;
  /// Size of the whole file in bytes.
  size_t size() const { return size_; }

 private:
  static Result<SafetensorsFile> ParseBytes(std::shared_ptr<const void> owner,
                                            std::string_view bytes, std::string display_name);
  Result<const TensorInfo*> Checked(std::string_view tensor,
                                    std::span<const int64_t> expected_shape) const;

  std::string name_;
  std::shared_ptr<const void> owner_;  // the mapping or the std::string holding the bytes
  const char* bytes_ = nullptr;
  size_t size_ = 0;
  size_t data_start_ = 0;
  std::vector<TensorInfo> tensors_;
  std::map<std::string, std::string> metadata_;
};

/// A model directory's tensors: `model.safetensors`, or the shards named by
/// `model.safetensors.index.json` (`{"weight_map": {tensor: file}}`; shard names must be plain
/// file names inside the directory).
class TensorStore {
 public:
  static Result<TensorStore> OpenDir(const std::string& dir);

  /// Sorted names of every tensor.
  std::vector<std::string> Names() const;
  bool Contains(std::string_view tensor) const;
  /// See SafetensorsFile::ReadFloat32; NotFound naming the tensor when no file holds it.
  Result<std::vector<float>> ReadFloat32(std::string_view tensor,
                                         std::span<const int64_t> expected_shape) const;
  /// See SafetensorsFile::Bytes; NotFound as ReadFloat32.
  Result<TensorBytes> Bytes(std::string_view tensor, std::span<const int64_t> expected_shape) const;
  /// Total size of the safetensors files in bytes.
  uint64_t FileBytes() const;

 private:
  std::vector<std::shared_ptr<SafetensorsFile>> files_;
  std::map<std::string, size_t, std::less<>> where_;  // tensor -> index into files_
};

/// One tensor to write. `data` holds prod(shape) elements of `dtype` (little-endian).
struct SafetensorsTensor {
  std::string name;
  std::string dtype;
  std::vector<int64_t> shape;
  std::string data;
};

/// The bytes of a safetensors file (tensors laid out in the given order, header padded with
/// spaces to a multiple of 8 bytes as the reference writer does). InvalidArgument when a
/// tensor's data size does not match its shape and dtype, or names repeat.
Result<std::string> SerializeSafetensors(const std::vector<SafetensorsTensor>& tensors,
                                         const std::map<std::string, std::string>& metadata);
/// SerializeSafetensors + write to `path`.
Status WriteSafetensors(const std::string& path, const std::vector<SafetensorsTensor>& tensors,
                        const std::map<std::string, std::string>& metadata);

}  // namespace kvbridge
