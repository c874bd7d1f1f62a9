// CudaModel without a CUDA build (KVBRIDGE_WITH_CUDA=OFF): every entry point says so.
#include "kvbridge/model/cuda_model.h"

namespace kvbridge {

namespace {
Status NoCuda() {
  return UnimplementedError("this kvbridge was built without CUDA (KVBRIDGE_WITH_CUDA=OFF)");
}
}  // namespace

struct CudaModel::Impl {
  PagedKvView view;
  CudaMemoryReport mem;
  std::string name;
  CudaModelOptions opt;
};

Status CudaDeviceAvailable(int) { return NoCuda(); }

CudaModel::CudaModel(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CudaModel::~CudaModel() = default;
Result<std::unique_ptr<CudaModel>> CudaModel::Create(std::shared_ptr<const Model>,
                                                     const CudaModelOptions&) {
  return NoCuda();
}
Result<std::unique_ptr<CudaModel>> CudaModel::CreateRandom(const RandomModelSpec&,
                                                           const CudaModelOptions&) {
  return NoCuda();
}
void CudaModel::SetStageTiming(bool) {}
std::vector<std::pair<std::string, double>> CudaModel::StageTimes() const { return {}; }
void CudaModel::ResetStageTimes() {}
Status CudaModel::Forward(const ForwardBatch&, std::vector<float>*) { return NoCuda(); }
const PagedKvView& CudaModel::kv_view() const { return impl_->view; }
Status CudaModel::CopyBlock(int32_t, int32_t) { return NoCuda(); }
Status CudaModel::FillKv(uint8_t) { return NoCuda(); }
Status CudaModel::XorKvByte(int, size_t, uint8_t) { return NoCuda(); }
Status CudaModel::ReadKvLayer(int, std::vector<uint8_t>*) const { return NoCuda(); }
Status CudaModel::WriteKvLayer(int, const std::vector<uint8_t>&) { return NoCuda(); }
void* CudaModel::layer_kv_event(int) const { return nullptr; }
const CudaMemoryReport& CudaModel::memory() const { return impl_->mem; }
Result<size_t> CudaModel::DeviceFreeBytes() const { return NoCuda(); }
int CudaModel::device() const { return impl_->opt.device; }
const std::string& CudaModel::device_name() const { return impl_->name; }
const CudaModelOptions& CudaModel::options() const { return impl_->opt; }

}  // namespace kvbridge
