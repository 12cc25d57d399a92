/* condition.h -- the kernel that sets a CUDA graph's conditional node from a
 * flag on the device (Note [Conditional regions] in aten_conditional.cpp).
 * Compiled by nvcc; called from the C++ half only. */
#ifndef CGRAPH_CONDITION_H
#define CGRAPH_CONDITION_H

#include <stdbool.h>

#include <cuda_runtime.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Whether this build can record conditional nodes: CUDA 12.4 and later. */
#define CG_HAS_CONDITIONAL_NODES (CUDART_VERSION >= 12040)

#if CG_HAS_CONDITIONAL_NODES
/* Enqueues on `stream` (a capture records it as one kernel node) a kernel
 * that sets `handle` to *flag when it runs.  Returns the launch error,
 * cudaSuccess if none. */
cudaError_t cg_set_condition(cudaGraphConditionalHandle handle, const bool *flag,
                             cudaStream_t stream);
#endif

#ifdef __cplusplus
}
#endif

#endif /* CGRAPH_CONDITION_H */
