// tensor_lists.cu -- the kernel of tensor_lists.h: each block moves 16 KiB
// of one item, so every item is spread over as many blocks as its size
// needs, and a list of any length and size is one launch (per 64 items).
#include "tensor_lists.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

namespace {

constexpr int kThreads = 256;
constexpr size_t kBlockBytes = 16 * 1024;  // a multiple of every element size and of 16
constexpr int kMaxItems = 64;              // the arguments stay under 4 KiB

struct ListArgs {
  cg_list_item items[kMaxItems];
  unsigned first_block[kMaxItems + 1];  // item i owns blocks [first_block[i], first_block[i+1])
  int count;
};

__device__ float to_float(float v) { return v; }
__device__ float to_float(__half v) { return __half2float(v); }
__device__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
template <class T>
__device__ T from_float(float v);
template <>
__device__ float from_float<float>(float v) { return v; }
template <>
__device__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

__device__ void copy_bytes(char* dst, const char* src, size_t begin, size_t end) {
  if (((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) | begin | end) &
       15) == 0) {
    auto* d = reinterpret_cast<uint4*>(dst);
    const auto* s = reinterpret_cast<const uint4*>(src);
    for (size_t i = begin / 16 + threadIdx.x; i < end / 16; i += kThreads) {
      d[i] = s[i];
    }
    return;
  }
  for (size_t i = begin + threadIdx.x; i < end; i += kThreads) {
    dst[i] = src[i];
  }
}

template <class T>
__device__ void add_elements(void* dst, const void* src, size_t begin, size_t end) {
  auto* d = static_cast<T*>(dst);
  const auto* s = static_cast<const T*>(src);
  for (size_t i = begin / sizeof(T) + threadIdx.x; i < end / sizeof(T); i += kThreads) {
    d[i] = from_float<T>(to_float(d[i]) + to_float(s[i]));
  }
}

__device__ void add_doubles(void* dst, const void* src, size_t begin, size_t end) {
  auto* d = static_cast<double*>(dst);
  const auto* s = static_cast<const double*>(src);
  for (size_t i = begin / sizeof(double) + threadIdx.x; i < end / sizeof(double);
       i += kThreads) {
    d[i] += s[i];
  }
}

template <cg_list_op Op>
__global__ void __launch_bounds__(kThreads) apply_list(const __grid_constant__ ListArgs args) {
  // The item this block works on: the last whose first block is not after it.
  int lo = 0, hi = args.count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (args.first_block[mid] <= blockIdx.x) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  const cg_list_item& item = args.items[lo];
  const size_t begin = static_cast<size_t>(blockIdx.x - args.first_block[lo]) * kBlockBytes;
  const size_t end = begin + kBlockBytes < item.bytes ? begin + kBlockBytes : item.bytes;
  switch (Op) {
    case CG_LIST_COPY:
      copy_bytes(static_cast<char*>(item.dst), static_cast<const char*>(item.src), begin, end);
      break;
    case CG_LIST_ADD_F32:
      add_elements<float>(item.dst, item.src, begin, end);
      break;
    case CG_LIST_ADD_F64:
      add_doubles(item.dst, item.src, begin, end);
      break;
    case CG_LIST_ADD_F16:
      add_elements<__half>(item.dst, item.src, begin, end);
      break;
    case CG_LIST_ADD_BF16:
      add_elements<__nv_bfloat16>(item.dst, item.src, begin, end);
      break;
  }
}

template <cg_list_op Op>
void launch(const ListArgs& args, unsigned blocks, cudaStream_t stream) {
  apply_list<Op><<<blocks, kThreads, 0, stream>>>(args);
}

// Indexed by cg_list_op.
using Launcher = void (*)(const ListArgs&, unsigned, cudaStream_t);
constexpr Launcher kLaunchers[] = {launch<CG_LIST_COPY>, launch<CG_LIST_ADD_F32>,
                                   launch<CG_LIST_ADD_F64>, launch<CG_LIST_ADD_F16>,
                                   launch<CG_LIST_ADD_BF16>};

}  // namespace

extern "C" cudaError_t cg_list_apply(cg_list_op op, const cg_list_item* items, size_t count,
                                     cudaStream_t stream) {
  size_t next = 0;
  while (next < count) {
    ListArgs args{};
    unsigned blocks = 0;
    for (; next < count && args.count < kMaxItems; ++next) {
      if (items[next].bytes == 0) {
        continue;
      }
      args.items[args.count] = items[next];
      args.first_block[args.count] = blocks;
      blocks += static_cast<unsigned>((items[next].bytes + kBlockBytes - 1) / kBlockBytes);
      ++args.count;
    }
    if (args.count == 0) {
      break;
    }
    args.first_block[args.count] = blocks;
    kLaunchers[op](args, blocks, stream);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) {
      return err;
    }
  }
  return cudaSuccess;
}
