// aten_workspace.cpp -- the cuBLAS workspace that graphs share with eager
// mode on the caller's stream, and torch's workspace entries cgraph manages.
#include "aten_graph.hpp"

#include <ATen/cuda/CUDAContextLight.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <iterator>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <shared_mutex>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace cgraph {

// Note [One cuBLAS workspace per stream]
// Q: Which memory do a graph's GEMMs use as their cuBLAS workspace?
// A: torch keeps a workspace per (cuBLAS handle, stream): 32 MiB on Hopper,
//    allocated at the handle's first GEMM on that stream, and every thread
//    has a handle of its own, so eager training holds two on its stream (the
//    caller's thread and autograd's device thread).  A capture's GEMMs used
//    to get theirs from the graph pool, one per pool: 32 MiB more for
//    whole-model graphs, and one per separately graphed layer.
//    A workspace is scratch that each GEMM writes before it reads, so GEMMs
//    ordered on one stream can share one.  Graphs replay on the stream they
//    were captured from, in order with the eager GEMMs there.  So cgraph
//    keeps one workspace per caller stream (BlasWorkspace) and points
//    torch's entries at it, on the caller stream and the capture stream,
//    for every handle eager mode or a warm-up used: eager mode's GEMMs on
//    both threads, the warm-ups and every capture made from that stream
//    share it.  Eager mode's two workspaces become one, and pools hold
//    none.  A handle on the caller stream counts only if its workspace is
//    on this device: the default stream is stream 0 on every device.
//    Ownership: the graphs (Engine::blas_workspace) and the set-up session.
//    torch's entries are aliases that own nothing, so torch.compile's
//    clearCublasWorkspaces() drops them without freeing memory a graph still
//    writes; when the last owner goes, the workspace erases its aliases and
//    torch allocates afresh, as after any clear.
//    Limits: a replay on another stream would race the caller stream's
//    GEMMs, so it is ordered after and before that stream (Note [Replays on
//    another stream], aten_replay.cpp); every set-up names the caller's
//    thread and autograd's (Note [Naming a thread's cuBLAS handle]), but
//    the first GEMM of another thread (one the user's callable starts)
//    gets a workspace of torch's: in a warm-up, on the capture stream,
//    until the warm-up ends; in a capture without warm-up, from the pool,
//    until the capture ends (drop_foreign_blas_workspaces).
namespace {

// An alias's deleter: torch's entry owns nothing; the BlasWorkspace does.
void owns_nothing(void*) {}

template <class WorkspaceMap>
using EntryOf =
    typename std::remove_reference_t<decltype(std::declval<WorkspaceMap&>().map)>::mapped_type;

// torch 2.11 maps to a DataPtr; later releases to (DataPtr, size).
template <class Entry>
const at::DataPtr& data_of(const Entry& entry) {
  if constexpr (std::is_same_v<Entry, at::DataPtr>) {
    return entry;
  } else {
    return entry.first;
  }
}

template <class Entry>
at::DataPtr& data_of(Entry& entry) {
  if constexpr (std::is_same_v<Entry, at::DataPtr>) {
    return entry;
  } else {
    return entry.first;
  }
}

template <class Entry>
Entry alias_entry(void* data, const void* owner, c10::Device device, size_t bytes) {
  at::DataPtr alias(data, const_cast<void*>(owner), &owns_nothing, device);
  if constexpr (std::is_same_v<Entry, at::DataPtr>) {
    return alias;
  } else {
    return Entry(std::move(alias), bytes);
  }
}

// Whether `data` is an alias of cgraph's: of `owner`'s, or of any if nullptr.
bool is_alias(const at::DataPtr& data, const void* owner) {
  return data.get_deleter() == &owns_nothing && (owner == nullptr || data.get_context() == owner);
}

// Points (handle, caller) and (handle, capture) at `data`, for `handles` and
// for the handles already pointed by an earlier session.
template <class WorkspaceMap>
void point_entries(WorkspaceMap& workspaces, cudaStream_t caller, cudaStream_t capture,
                   std::set<void*> handles, void* data, const void* owner,
                   c10::Device device, size_t bytes) {
  using Entry = EntryOf<WorkspaceMap>;
  std::unique_lock<std::shared_mutex> lock(workspaces.mutex);
  for (const auto& entry : workspaces.map) {
    // The capture stream's aliases name the threads earlier sessions
    // warmed up; the caller stream's aliases of this workspace name them
    // still after torch dropped the capture stream's (a graph's reset).
    void* stream = std::get<1>(entry.first);
    const at::DataPtr& data = data_of(entry.second);
    if ((stream == static_cast<void*>(capture) && is_alias(data, nullptr)) ||
        (stream == static_cast<void*>(caller) && is_alias(data, owner))) {
      handles.insert(std::get<0>(entry.first));
    }
  }
  for (void* handle : handles) {
    for (cudaStream_t stream : {caller, capture}) {
      workspaces.map.insert_or_assign(std::make_tuple(handle, static_cast<void*>(stream)),
                                      alias_entry<Entry>(data, owner, device, bytes));
    }
  }
}

// Erases the entries on `stream` (nullopt: on every stream; nullptr is the
// default stream) that `keep` rejects, and returns their handles.  Their
// memory moves to `taken` if given, else goes back to torch's cache.
template <class WorkspaceMap, class Keep>
std::set<void*> erase_entries(WorkspaceMap& workspaces, std::optional<cudaStream_t> stream,
                              Keep keep, std::vector<at::DataPtr>* taken = nullptr) {
  std::set<void*> erased;
  std::unique_lock<std::shared_mutex> lock(workspaces.mutex);
  for (auto it = workspaces.map.begin(); it != workspaces.map.end();) {
    const bool on_stream = !stream || std::get<1>(it->first) == static_cast<void*>(*stream);
    if (on_stream && !keep(data_of(it->second))) {
      if (taken != nullptr) {
        taken->push_back(std::move(data_of(it->second)));
      }
      erased.insert(std::get<0>(it->first));
      it = workspaces.map.erase(it);
    } else {
      ++it;
    }
  }
  return erased;
}

// The calling thread's handle: Note [Naming a thread's cuBLAS handle].
template <class GetHandle>
void* handle_of_this_thread(GetHandle get) {
  if constexpr (std::is_invocable_v<GetHandle, bool>) {
    return static_cast<void*>(get(false));
  } else {
    using Key = std::tuple<void*, void*>;
    auto& workspaces = at::cuda::cublas_handle_stream_to_workspace();
    std::set<Key> named_before;
    {
      std::shared_lock<std::shared_mutex> lock(workspaces.mutex);
      for (const auto& entry : workspaces.map) {
        named_before.insert(entry.first);
      }
    }
    void* handle = static_cast<void*>(get());
    const Key key(handle, static_cast<void*>(c10::cuda::getCurrentCUDAStream().stream()));
    if (named_before.count(key) == 0) {
      // Made just now, used by no GEMM: freed here.  The handle keeps its
      // address until its next use, which, through torch, sets the
      // workspace the entry then names.
      std::unique_lock<std::shared_mutex> lock(workspaces.mutex);
      workspaces.map.erase(key);
    }
    return handle;
  }
}

using Registry = std::map<std::pair<c10::DeviceIndex, cudaStream_t>, std::weak_ptr<BlasWorkspace>>;

Registry& registry(std::unique_lock<std::mutex>& lock) {
  static std::mutex mutex;
  static Registry workspaces;
  lock = std::unique_lock<std::mutex>(mutex);
  return workspaces;
}

}  // namespace

// One workspace shared by the graphs captured from one stream and the eager
// GEMMs on it: Note [One cuBLAS workspace per stream].
class BlasWorkspace {
 public:
  // `adopted`: a workspace of torch's on `caller`, large enough, that
  // becomes this one; else one is allocated.
  BlasWorkspace(const c10::cuda::CUDAStream& caller, std::optional<at::DataPtr> adopted)
      : caller_(caller),
        blas_bytes_(at::cuda::getChosenWorkspaceSize()),
        lt_bytes_(at::cuda::getCUDABlasLtWorkspaceSize()) {
    if (adopted) {
      memory_ = std::move(*adopted);
      return;
    }
    c10::cuda::CUDAStreamGuard on_caller(caller);  // freed in the caller stream's order
    memory_ = c10::cuda::CUDACachingAllocator::get()->allocate(std::max(blas_bytes_, lt_bytes_));
  }

  ~BlasWorkspace() {
    const auto not_mine = [this](const at::DataPtr& data) { return !is_alias(data, this); };
    erase_entries(at::cuda::cublas_handle_stream_to_workspace(), std::nullopt, not_mine);
    erase_entries(at::cuda::cublaslt_handle_stream_to_workspace(), std::nullopt, not_mine);
  }

  BlasWorkspace(const BlasWorkspace&) = delete;
  BlasWorkspace& operator=(const BlasWorkspace&) = delete;

  void point_torch_at_this(cudaStream_t capture, const std::set<void*>& handles) {
    void* data = memory_.get();
    const c10::Device device = memory_.device();
    point_entries(at::cuda::cublas_handle_stream_to_workspace(), caller_.stream(), capture,
                  handles, data, this, device, blas_bytes_);
    point_entries(at::cuda::cublaslt_handle_stream_to_workspace(), caller_.stream(), capture,
                  handles, data, this, device, lt_bytes_);
  }

 private:
  c10::cuda::CUDAStream caller_;
  size_t blas_bytes_;
  size_t lt_bytes_;
  at::DataPtr memory_;
};

std::shared_ptr<BlasWorkspace> live_blas_workspace(const c10::cuda::CUDAStream& caller) {
  std::unique_lock<std::mutex> lock;
  Registry& workspaces = registry(lock);
  const auto it = workspaces.find({caller.device_index(), caller.stream()});
  return it == workspaces.end() ? nullptr : it->second.lock();
}

std::shared_ptr<BlasWorkspace> share_blas_workspace(const c10::cuda::CUDAStream& caller,
                                                    cudaStream_t capture,
                                                    std::set<void*> handles,
                                                    std::vector<at::DataPtr>& replaced) {
  // Eager GEMMs' threads too, so a warm-up, or a capture without one, uses
  // the shared workspace from its first GEMM.  Only this device's: the
  // default stream is stream 0 on every device.  Their workspaces go to
  // `replaced`, not back to the cache: another thread may have read one
  // just before, for a GEMM it has yet to launch.
  const c10::DeviceIndex device = caller.device_index();
  const auto not_torchs_here = [device](const at::DataPtr& data) {
    return is_alias(data, nullptr) || data.device().index() != device;
  };
  std::vector<at::DataPtr> blas_taken, lt_taken;
  handles.merge(erase_entries(at::cuda::cublas_handle_stream_to_workspace(), caller.stream(),
                              not_torchs_here, &blas_taken));
  handles.merge(erase_entries(at::cuda::cublaslt_handle_stream_to_workspace(), caller.stream(),
                              not_torchs_here, &lt_taken));
  std::shared_ptr<BlasWorkspace> workspace = live_blas_workspace(caller);
  // The first shared workspace is one of eager mode's, if one is large
  // enough (each kind of handle has its own size), so that sharing adds no
  // workspace to the peak: the caller's GEMMs that may still read it run on
  // the caller stream, in order with every later use.
  const bool blas_larger = at::cuda::getChosenWorkspaceSize() >= at::cuda::getCUDABlasLtWorkspaceSize();
  std::vector<at::DataPtr>& large_enough = blas_larger ? blas_taken : lt_taken;
  std::optional<at::DataPtr> adopted;
  if (!workspace && !large_enough.empty()) {
    adopted = std::move(large_enough.back());
    large_enough.pop_back();
  }
  for (auto* taken : {&blas_taken, &lt_taken}) {
    std::move(taken->begin(), taken->end(), std::back_inserter(replaced));
  }
  if (!workspace) {
    // Allocates unless it adopts: not under the lock.
    auto made = std::make_shared<BlasWorkspace>(caller, std::move(adopted));
    std::unique_lock<std::mutex> lock;
    std::weak_ptr<BlasWorkspace>& slot = registry(lock)[{caller.device_index(), caller.stream()}];
    workspace = slot.lock();
    if (!workspace) {
      slot = made;
      workspace = std::move(made);
    }
  }
  workspace->point_torch_at_this(capture, handles);
  return workspace;
}

std::set<void*> drop_foreign_blas_workspaces(cudaStream_t stream) {
  const auto cgraphs = [](const at::DataPtr& data) { return is_alias(data, nullptr); };
  std::set<void*> handles =
      erase_entries(at::cuda::cublas_handle_stream_to_workspace(), stream, cgraphs);
  handles.merge(erase_entries(at::cuda::cublaslt_handle_stream_to_workspace(), stream, cgraphs));
  return handles;
}

// Note [Naming a thread's cuBLAS handle]
// Q: Why does open_setup name the handles of the caller's thread and of
//    autograd's device thread before warm-up, and how?
// A: Only a handle that torch's workspace entries name can be pointed at
//    the shared workspace.  A thread that ran no GEMM since torch's entries
//    were last cleared (a script that graphs its model before training;
//    torch.compile's clears) is named nowhere, and its first GEMM in the
//    warm-up gets a workspace of torch's on the capture stream: with both
//    threads, 64 MiB on Hopper on top of the warm-up's peak, then the
//    shared one.  So the set-up names both threads' handles first
//    (autograd's through a one-element backward, once per device: its
//    thread lives as long as the process).  torch releases with
//    getCurrentCUDABlasHandle(setup=false) name a handle without touching
//    its workspace.  Older ones (torch 2.11) give the handle a workspace on
//    the current stream, the caller's, if it has none there; no GEMM has
//    used it yet, so it is freed at once, and the next naming, then the
//    shared workspace, reuse its block: one 32 MiB segment in all.
//    The cost: a callable that runs no GEMM gets the shared workspace too,
//    held while its graphs live, where eager mode would make one at the
//    first GEMM on that stream (a training script's loss head, at the
//    latest), which then shares it.
void* blas_handle_of_this_thread() {
  return handle_of_this_thread(&at::cuda::getCurrentCUDABlasHandle);
}

}  // namespace cgraph
