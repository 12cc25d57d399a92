// aten_inspect.cpp -- what a captured graph is made of, for introspection.
//
// Read from the cudaGraph_t every cgraph Graph keeps (its switchable nodes
// live there, aten_graph_nodes.cpp); nothing here runs on the replay path.
#include "aten_graph.hpp"

#include <c10/cuda/CUDAException.h>

namespace cgraph {

bool Graph::shape(cg_graph_shape* out) const {
  if (!has_graph_ || graph_ == nullptr) {
    return false;
  }
  *out = cg_graph_shape{};
  size_t count = 0;
  C10_CUDA_CHECK(cudaGraphGetNodes(graph_, nullptr, &count));
  std::vector<cudaGraphNode_t> nodes(count);
  C10_CUDA_CHECK(cudaGraphGetNodes(graph_, nodes.data(), &count));
  out->nodes = count;
  for (cudaGraphNode_t node : nodes) {
    cudaGraphNodeType type;
    C10_CUDA_CHECK(cudaGraphNodeGetType(node, &type));
    switch (type) {
      case cudaGraphNodeTypeKernel:
        ++out->kernels;
        break;
      case cudaGraphNodeTypeMemcpy:
        ++out->memcpys;
        break;
      case cudaGraphNodeTypeMemset:
        ++out->memsets;
        break;
      default:
        ++out->others;
    }
  }
  size_t roots = 0, edges = 0;
  C10_CUDA_CHECK(cudaGraphGetRootNodes(graph_, nullptr, &roots));
#if CUDART_VERSION >= 13000
  C10_CUDA_CHECK(cudaGraphGetEdges(graph_, nullptr, nullptr, nullptr, &edges));
#else
  C10_CUDA_CHECK(cudaGraphGetEdges(graph_, nullptr, nullptr, &edges));
#endif
  out->roots = roots;
  out->edges = edges;
  return true;
}

}  // namespace cgraph
