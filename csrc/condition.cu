// condition.cu -- the kernel of condition.h.
#include "condition.h"

#if CG_HAS_CONDITIONAL_NODES

namespace {

__global__ void set_condition(cudaGraphConditionalHandle handle, const bool* flag) {
  cudaGraphSetConditional(handle, *flag ? 1u : 0u);
}

}  // namespace

cudaError_t cg_set_condition(cudaGraphConditionalHandle handle, const bool* flag,
                             cudaStream_t stream) {
  set_condition<<<1, 1, 0, stream>>>(handle, flag);
  return cudaGetLastError();
}

#endif
