/* tensor_lists.h -- one launch that copies, or adds, a list of tensors.
 *
 * The parameter-grad tails of a backward graph (Note [Parameter gradients]
 * in aten_replay.cpp) were ATen's _foreach_copy_ and _foreach_add_, whose
 * kernel gives each block 64K elements: a 1 MiB grad is copied by four
 * blocks, in 8 us on an H100, whatever the list's size.  This kernel gives a
 * block 16 KiB, so a list takes as long as its bytes take to move (about
 * 2 us for one mlp block's grads), and one launch still covers every
 * parameter.  Compiled by nvcc; called from the C++ half only.
 */
#ifndef CGRAPH_TENSOR_LISTS_H
#define CGRAPH_TENSOR_LISTS_H

#include <stddef.h>

#include <cuda_runtime.h>

#ifdef __cplusplus
extern "C" {
#endif

/* What cg_list_apply does to each item: a byte copy, or dst += src in the
 * items' element type (arithmetic in float for the 16-bit types, rounded
 * once, as ATen's add_ does). */
typedef enum {
  CG_LIST_COPY,
  CG_LIST_ADD_F32,
  CG_LIST_ADD_F64,
  CG_LIST_ADD_F16,
  CG_LIST_ADD_BF16,
} cg_list_op;

/* One tensor: `bytes` contiguous bytes at `dst` and at `src`, which do not
 * overlap; both aligned to the element size. */
typedef struct {
  void* dst;
  const void* src;
  size_t bytes;
} cg_list_item;

/* Enqueues `op` on every item on `stream` (a kernel launch per 64 items),
 * so that a stream capture records it as kernel nodes.  Returns the launch
 * error, cudaSuccess if none. */
cudaError_t cg_list_apply(cg_list_op op, const cg_list_item* items, size_t count,
                          cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif /* CGRAPH_TENSOR_LISTS_H */
