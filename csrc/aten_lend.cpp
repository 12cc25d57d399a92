// aten_lend.cpp -- a tensor's storage lent memory of another's: the fixed
// homes of FSDP2's unsharded parameters in per-layer graphs (Note [FSDP2's
// unsharded parameters in per-layer graphs] in cgraph/_fsdp.py).
#include "aten_engine.hpp"

#include <c10/core/Storage.h>

namespace cgraph {

namespace {

void release_home(void* ctx) {
  delete static_cast<c10::Storage*>(ctx);
}

}  // namespace

// The StorageImpl itself is repointed, not the tensor: every tensor over it
// (FSDP's all-gather output, the unsharded parameter viewing it, a weight
// autograd saved) then reads the home.  The storage holds a reference to the
// home's storage until it is resized (FSDP's free_storage) or lent again.
void lend_memory(const at::Tensor& t, const at::Tensor& home) {
  TORCH_CHECK(t.is_cuda() && home.device() == t.device(),
              "cgraph: lend_memory: both tensors must be on one CUDA device, got ", t.device(),
              " and ", home.device());
  const size_t nbytes = static_cast<size_t>(t.numel()) * t.element_size();
  TORCH_CHECK(t.storage_offset() == 0 && t.is_contiguous() && home.is_contiguous() &&
                  static_cast<size_t>(home.numel()) * home.element_size() == nbytes,
              "cgraph: lend_memory: a contiguous tensor of ", nbytes,
              " bytes at storage offset 0 needs a home of as many bytes, got ",
              home.numel() * home.element_size(), " (a bug in cgraph)");
  c10::StorageImpl& storage = *t.storage().unsafeGetStorageImpl();
  void* data = home.data_ptr();
  if (storage.data() == data && storage.nbytes() == nbytes) {
    return;  // lent already
  }
  storage.set_data_ptr_noswap(
      at::DataPtr(data, new c10::Storage(home.storage()), &release_home, t.device()));
  storage.set_nbytes(nbytes);
}

const void* lent_from_home(const at::Tensor& t) {
  if (!t.has_storage() || t.storage().data_ptr().get_deleter() != &release_home) {
    return nullptr;
  }
  return t.const_data_ptr();
}

}  // namespace cgraph
