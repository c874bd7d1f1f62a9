#include "kvbridge/model/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "model/numerics.h"

namespace kvbridge {
namespace {

using model_internal::Bf16ToFloat;
using model_internal::Fp16ToFloat;
using nlohmann::json;

// The reference implementation refuses headers above 100 MB; so do we.
constexpr uint64_t kMaxHeaderBytes = 100ull << 20;

std::string ShapeString(std::span<const int64_t> shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ",";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

// A read-only private mapping of a whole file, unmapped on destruction.
class MappedFile {
 public:
  static Result<std::shared_ptr<MappedFile>> Map(const std::string& path) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return NotFoundError(path + ": cannot open");
    struct stat st;
    if (::fstat(fd, &st) != 0) {
      const int e = errno;
      ::close(fd);
      return ErrnoToStatus(e, path + ": fstat");
    }
    auto m = std::shared_ptr<MappedFile>(new MappedFile());
    m->size_ = static_cast<size_t>(st.st_size);
    if (m->size_ > 0) {
      void* p = ::mmap(nullptr, m->size_, PROT_READ, MAP_PRIVATE, fd, 0);
      if (p == MAP_FAILED) {
        const int e = errno;
        ::close(fd);
        return ErrnoToStatus(e, path + ": mmap");
      }
      m->data_ = static_cast<const char*>(p);
    }
    ::close(fd);
    return m;
  }
  ~MappedFile() {
    if (data_ != nullptr) ::munmap(const_cast<char*>(data_), size_);
  }
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  const char* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  MappedFile() = default;
  const char* data_ = nullptr;
  size_t size_ = 0;
};

std::string BaseName(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

}  // namespace

size_t SafetensorsDtypeSize(std::string_view d) {
  if (d == "F64" || d == "I64" || d == "U64") return 8;
  if (d == "F32" || d == "I32" || d == "U32") return 4;
  if (d == "F16" || d == "BF16" || d == "I16" || d == "U16") return 2;
  if (d == "I8" || d == "U8" || d == "BOOL" || d == "F8_E4M3" || d == "F8_E5M2") return 1;
  return 0;
}

Result<SafetensorsFile> SafetensorsFile::Open(const std::string& path) {
  ASSIGN_OR_RETURN(std::shared_ptr<MappedFile> map, MappedFile::Map(path));
  const std::string_view bytes(map->data() == nullptr ? "" : map->data(), map->size());
  return ParseBytes(std::move(map), bytes, path);
}

Result<SafetensorsFile> SafetensorsFile::Parse(std::string bytes, std::string display_name) {
  auto owned = std::make_shared<const std::string>(std::move(bytes));
  const std::string_view view(*owned);
  return ParseBytes(std::move(owned), view, std::move(display_name));
}

Result<SafetensorsFile> SafetensorsFile::ParseBytes(std::shared_ptr<const void> owner,
                                                    std::string_view bytes,
                                                    std::string display_name) {
  auto err = [&](const std::string& what) {
    return InvalidArgumentError(display_name + ": " + what);
  };
  if (bytes.size() < 8) {
    return DataLossError(display_name + ": truncated: " + std::to_string(bytes.size()) +
                         " bytes, the 8-byte header length is missing");
  }
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<uint8_t>(bytes[i]);
  if (n > kMaxHeaderBytes) return err("header length " + std::to_string(n) + " exceeds 100 MB");
  if (n > bytes.size() - 8) {
    return DataLossError(display_name + ": truncated: header length " + std::to_string(n) +
                         " but only " + std::to_string(bytes.size() - 8) + " bytes follow");
  }
  const std::string_view header(bytes.data() + 8, n);
  json j = json::parse(header, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return err("header is not valid JSON");
  if (!j.is_object()) return err("header is not a JSON object");
  SafetensorsFile f;
  f.name_ = display_name;
  f.data_start_ = 8 + n;
  const uint64_t data_size = bytes.size() - f.data_start_;
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string& key = it.key();
    const json& v = it.value();
    if (key == "__metadata__") {
      if (!v.is_object()) return err("__metadata__ is not an object");
      for (auto m = v.begin(); m != v.end(); ++m) {
        if (!m.value().is_string())
          return err("__metadata__ value '" + m.key() + "' is not a string");
        f.metadata_[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    auto terr = [&](const std::string& what) { return err("tensor '" + key + "': " + what); };
    if (!v.is_object()) return terr("entry is not an object");
    TensorInfo t;
    t.name = key;
    auto dt = v.find("dtype");
    if (dt == v.end() || !dt->is_string()) return terr("missing string 'dtype'");
    t.dtype = dt->get<std::string>();
    const size_t esize = SafetensorsDtypeSize(t.dtype);
    if (esize == 0) return terr("unknown dtype '" + t.dtype + "'");
    auto sh = v.find("shape");
    if (sh == v.end() || !sh->is_array()) return terr("missing array 'shape'");
    uint64_t elems = 1;
    bool overflow = false;
    for (const auto& d : *sh) {
      if (!d.is_number_unsigned()) return terr("shape holds a non-integer or negative dimension");
      const uint64_t dim = d.get<uint64_t>();
      if (dim > (uint64_t{1} << 62)) return terr("shape dimension too large");
      t.shape.push_back(static_cast<int64_t>(dim));
      if (dim != 0 && elems > UINT64_MAX / dim) overflow = true;
      elems *= dim;
    }
    auto off = v.find("data_offsets");
    if (off == v.end() || !off->is_array() || off->size() != 2 || !(*off)[0].is_number_unsigned() ||
        !(*off)[1].is_number_unsigned()) {
      return terr("'data_offsets' must be two non-negative integers");
    }
    t.begin = (*off)[0].get<uint64_t>();
    t.end = (*off)[1].get<uint64_t>();
    if (t.begin > t.end || t.end > data_size) {
      return terr("data_offsets [" + std::to_string(t.begin) + "," + std::to_string(t.end) +
                  "] outside the data section of " + std::to_string(data_size) + " bytes");
    }
    if (overflow || elems > UINT64_MAX / esize || elems * esize != t.end - t.begin) {
      return terr("shape " + ShapeString(t.shape) + " of " + t.dtype + " needs " +
                  (overflow ? std::string("too many") : std::to_string(elems * esize)) +
                  " bytes but data_offsets span " + std::to_string(t.end - t.begin));
    }
    f.tensors_.push_back(std::move(t));
  }
  // Tensors must not overlap (the format requires a dense, non-overlapping layout).
  std::vector<const TensorInfo*> by_begin;
  for (const auto& t : f.tensors_) by_begin.push_back(&t);
  std::sort(by_begin.begin(), by_begin.end(), [](const TensorInfo* a, const TensorInfo* b) {
    return a->begin != b->begin ? a->begin < b->begin : a->end < b->end;
  });
  for (size_t i = 1; i < by_begin.size(); ++i) {
    if (by_begin[i]->begin < by_begin[i - 1]->end) {
      return err("tensors '" + by_begin[i - 1]->name + "' and '" + by_begin[i]->name + "' overlap");
    }
  }
  f.owner_ = std::move(owner);
  f.bytes_ = bytes.data();
  f.size_ = bytes.size();
  return f;
}

const TensorInfo* SafetensorsFile::Find(std::string_view tensor) const {
  for (const auto& t : tensors_) {
    if (t.name == tensor) return &t;
  }
  return nullptr;
}

std::string_view SafetensorsFile::Data(const TensorInfo& info) const {
  return std::string_view(bytes_, size_).substr(data_start_ + info.begin, info.end - info.begin);
}

Result<const TensorInfo*> SafetensorsFile::Checked(std::string_view tensor,
                                                   std::span<const int64_t> expected_shape) const {
  const TensorInfo* t = Find(tensor);
  const std::string where = BaseName(name_) + ": tensor '" + std::string(tensor) + "'";
  if (t == nullptr) return NotFoundError(where + ": not found");
  if (!expected_shape.empty() &&
      !std::equal(expected_shape.begin(), expected_shape.end(), t->shape.begin(), t->shape.end())) {
    return InvalidArgumentError(where + ": expected shape " + ShapeString(expected_shape) +
                                ", found " + ShapeString(t->shape));
  }
  if (t->dtype != "F32" && t->dtype != "BF16" && t->dtype != "F16" && t->dtype != "F64") {
    return InvalidArgumentError(where + ": expected dtype BF16, F16, F32 or F64, found " +
                                t->dtype);
  }
  return t;
}

Result<TensorBytes> SafetensorsFile::Bytes(std::string_view tensor,
                                           std::span<const int64_t> expected_shape) const {
  ASSIGN_OR_RETURN(const TensorInfo* t, Checked(tensor, expected_shape));
  return TensorBytes{t->dtype, t->shape, Data(*t)};
}

Result<std::vector<float>> SafetensorsFile::ReadFloat32(
    std::string_view tensor, std::span<const int64_t> expected_shape) const {
  ASSIGN_OR_RETURN(const TensorInfo* t, Checked(tensor, expected_shape));
  const std::string_view d = Data(*t);
  std::vector<float> out;
  if (t->dtype == "F32") {
    out.resize(d.size() / 4);
    // A zero-element tensor leaves out.data() null; memcpy's arguments must never be null.
    if (!out.empty()) std::memcpy(out.data(), d.data(), out.size() * 4);
  } else if (t->dtype == "BF16" || t->dtype == "F16") {
    out.resize(d.size() / 2);
    const bool bf = t->dtype == "BF16";
    for (size_t i = 0; i < out.size(); ++i) {
      uint16_t h;
      std::memcpy(&h, d.data() + 2 * i, 2);
      out[i] = bf ? Bf16ToFloat(h) : Fp16ToFloat(h);
    }
  } else if (t->dtype == "F64") {
    out.resize(d.size() / 8);
    for (size_t i = 0; i < out.size(); ++i) {
      double v;
      std::memcpy(&v, d.data() + 8 * i, 8);
      out[i] = static_cast<float>(v);
    }
  }
  return out;
}

Result<TensorStore> TensorStore::OpenDir(const std::string& dir) {
  TensorStore store;
  const std::string index_path = dir + "/model.safetensors.index.json";
  std::ifstream index_in(index_path, std::ios::binary);
  if (!index_in) {
    ASSIGN_OR_RETURN(auto file, SafetensorsFile::Open(dir + "/model.safetensors"));
    auto shared = std::make_shared<SafetensorsFile>(std::move(file));
    store.files_.push_back(shared);
    for (const auto& t : shared->tensors()) store.where_[t.name] = 0;
    return store;
  }
  std::stringstream ss;
  ss << index_in.rdbuf();
  json j = json::parse(ss.str(), nullptr, false);
  auto ierr = [&](const std::string& what) {
    return InvalidArgumentError(index_path + ": " + what);
  };
  if (j.is_discarded() || !j.is_object()) return ierr("not a JSON object");
  auto wm = j.find("weight_map");
  if (wm == j.end() || !wm->is_object()) return ierr("missing object 'weight_map'");
  std::map<std::string, size_t> file_index;
  for (auto it = wm->begin(); it != wm->end(); ++it) {
    if (!it.value().is_string()) return ierr("weight_map['" + it.key() + "'] is not a string");
    const std::string shard = it.value().get<std::string>();
    if (shard.empty() || shard.find('/') != std::string::npos || shard == "." || shard == "..") {
      return ierr("shard name '" + shard + "' must be a plain file name in the model directory");
    }
    auto fi = file_index.find(shard);
    if (fi == file_index.end()) {
      ASSIGN_OR_RETURN(auto file, SafetensorsFile::Open(dir + "/" + shard));
      store.files_.push_back(std::make_shared<SafetensorsFile>(std::move(file)));
      fi = file_index.emplace(shard, store.files_.size() - 1).first;
    }
    if (store.files_[fi->second]->Find(it.key()) == nullptr) {
      return ierr("tensor '" + it.key() + "' is mapped to " + shard + " which does not hold it");
    }
    store.where_[it.key()] = fi->second;
  }
  return store;
}

std::vector<std::string> TensorStore::Names() const {
  std::vector<std::string> names;
  for (const auto& [n, i] : where_) names.push_back(n);
  return names;
}

bool TensorStore::Contains(std::string_view tensor) const {
  return where_.find(tensor) != where_.end();
}

Result<std::vector<float>> TensorStore::ReadFloat32(std::string_view tensor,
                                                    std::span<const int64_t> expected_shape) const {
  auto it = where_.find(tensor);
  if (it == where_.end()) {
    std::string files;
    for (const auto& f : files_) files += (files.empty() ? "" : ", ") + BaseName(f->name());
    return NotFoundError("tensor '" + std::string(tensor) + "' not found in " + files);
  }
  return files_[it->second]->ReadFloat32(tensor, expected_shape);
}

Result<TensorBytes> TensorStore::Bytes(std::string_view tensor,
                                       std::span<const int64_t> expected_shape) const {
  auto it = where_.find(tensor);
  if (it == where_.end()) {
    std::string files;
    for (const auto& f : files_) files += (files.empty() ? "" : ", ") + BaseName(f->name());
    return NotFoundError("tensor '" + std::string(tensor) + "' not found in " + files);
  }
  return files_[it->second]->Bytes(tensor, expected_shape);
}

uint64_t TensorStore::FileBytes() const {
  uint64_t n = 0;
  for (const auto& f : files_) n += f->size();
  return n;
}

Result<std::string> SerializeSafetensors(const std::vector<SafetensorsTensor>& tensors,
                                         const std::map<std::string, std::string>& metadata) {
  json header = json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  std::set<std::string> names;
  for (const auto& t : tensors) {
    if (t.name == "__metadata__" || !names.insert(t.name).second) {
      return InvalidArgumentError("tensor name '" + t.name + "' repeats or is reserved");
    }
    const size_t esize = SafetensorsDtypeSize(t.dtype);
    if (esize == 0)
      return InvalidArgumentError("tensor '" + t.name + "': unknown dtype " + t.dtype);
    uint64_t elems = 1;
    for (int64_t d : t.shape) {
      if (d < 0) return InvalidArgumentError("tensor '" + t.name + "': negative dimension");
      elems *= static_cast<uint64_t>(d);
    }
    if (elems * esize != t.data.size()) {
      return InvalidArgumentError("tensor '" + t.name + "': shape " + ShapeString(t.shape) +
                                  " needs " + std::to_string(elems * esize) + " bytes, got " +
                                  std::to_string(t.data.size()));
    }
    header[t.name] = {
        {"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {offset, offset + t.data.size()}}};
    offset += t.data.size();
  }
  std::string h = header.dump();
  while (h.size() % 8 != 0) h.push_back(' ');
  std::string out;
  out.reserve(8 + h.size() + offset);
  uint64_t n = h.size();
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((n >> (8 * i)) & 0xff));
  out += h;
  for (const auto& t : tensors) out += t.data;
  return out;
}

Status WriteSafetensors(const std::string& path, const std::vector<SafetensorsTensor>& tensors,
                        const std::map<std::string, std::string>& metadata) {
  ASSIGN_OR_RETURN(std::string bytes, SerializeSafetensors(tensors, metadata));
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) return ErrnoToStatus(errno, "open " + path);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  out.close();
  if (!out) return ErrnoToStatus(errno, "write " + path);
  return OkStatus();
}

}  // namespace kvbridge
