// The samples headwise.linear.weight_cache keeps of the weights its copies were made from, for contiguous CPU tensors:
// the first and last SPAN bytes of each, compared in one call (watched_changed) where Python read them one tensor at a
// time. A step that has just streamed every weight through the caches finds none of those bytes there: in Python each
// sample was a chain of dependent misses (the tensor object, its storage, its two ends), some 2 µs a weight; here the
// tensors' pointers are read first and their ends asked into the cache together. Built at run time with headwise's
// other ops (headwise.native); the schemas live in headwise.linear.weight_cache, which decides what is watched here.
#include <Python.h>

#include <ATen/ATen.h>
#include <c10/core/TensorImpl.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <mutex>
#include <utility>
#include <vector>

namespace {

constexpr int64_t SPAN = 64;  // bytes sampled at each end (weight_cache.SPAN)

// One watched tensor: its key (the Python tensor's id), a weak reference to it (no weight is kept alive by being
// watched), where its bytes were and how many, and its two ends as last seen.
struct Watched {
  int64_t key;
  c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl> tensor;
  const char* address;
  int64_t size;
  char ends[2 * SPAN];
};

std::mutex guard;  // the table, for threads that share a model
std::vector<Watched> table;  // side by side: the check walks it in order

// The first and last min(size, SPAN) bytes from address, side by side in out.
void read_ends(const char* address, int64_t size, char* out) {
  const int64_t n = std::min(size, SPAN);
  std::memcpy(out, address, n);
  std::memcpy(out + n, address + size - n, n);
}

// A tensor's bytes where they are and how many, if it is still a contiguous CPU tensor with storage; else {nullptr, 0}.
// Read through the tensor without taking a reference to it: taking one is an atomic write to a line that is not in
// the cache, and those do not overlap.
std::pair<const char*, int64_t> bytes_of(const c10::TensorImpl& t) {
  if (t.device_type() != c10::DeviceType::CPU || !t.has_storage() || !t.dtype_initialized() || !t.storage_initialized()
      || !t.is_contiguous() || t.numel() == 0) {
    return {nullptr, 0};
  }
  return {static_cast<const char*>(t.data()), static_cast<int64_t>(t.numel() * t.itemsize())};
}

// t (a contiguous CPU tensor) watched under `key` from now on, its ends as they are now (a key watched before: replaced).
void watch_ends(const at::Tensor& t, int64_t key) {
  const auto [address, size] = bytes_of(*t.unsafeGetTensorImpl());
  TORCH_CHECK(address != nullptr, "watch_ends: t must be a non-empty contiguous CPU tensor with storage");
  Watched w{key, c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>(t.getIntrusivePtr()), address, size, {}};
  read_ends(address, size, w.ends);
  std::lock_guard<std::mutex> lock(guard);
  const auto it = std::find_if(table.begin(), table.end(), [&](const Watched& e) { return e.key == key; });
  if (it != table.end()) *it = std::move(w);
  else table.push_back(std::move(w));
}

void watch_forget(int64_t key) {
  std::lock_guard<std::mutex> lock(guard);
  table.erase(std::remove_if(table.begin(), table.end(), [&](const Watched& e) { return e.key == key; }), table.end());
}

// The keys whose tensor's ends changed since they were last seen (the new ends kept). A tensor that died is dropped; one
// whose bytes moved or changed size is passed by (weight_cache.state sees that, and a new copy watches it again). Under
// the GIL (the op's call let it go): no Python thread swaps a watched tensor's storage while its ends are read, and a
// tensor that dies first runs weight_cache._forget, which waits for the table.
struct Gil {  // the GIL held while it lives
  PyGILState_STATE state = PyGILState_Ensure();
  ~Gil() { PyGILState_Release(state); }
};

std::vector<int64_t> watched_changed() {
  std::vector<int64_t> changed;
  {
    const Gil gil;
    std::lock_guard<std::mutex> lock(guard);
    std::vector<Watched*> live;
    live.reserve(table.size());
    table.erase(std::remove_if(table.begin(), table.end(), [](const Watched& e) { return e.tensor.expired(); }), table.end());
    for (Watched& w : table) {
      const auto [address, size] = bytes_of(*w.tensor._unsafe_get_target());
      if (address == w.address && size == w.size) {
        __builtin_prefetch(address);  // both ends of every tensor asked for before any is read: the misses overlap
        __builtin_prefetch(address + size - std::min(size, SPAN));
        live.push_back(&w);
      }
    }
    char now[2 * SPAN];
    for (Watched* w : live) {
      read_ends(w->address, w->size, now);
      const int64_t n = 2 * std::min(w->size, SPAN);
      if (std::memcmp(now, w->ends, n) != 0) {
        std::memcpy(w->ends, now, n);
        changed.push_back(w->key);
      }
    }
  }
  return changed;
}

}  // namespace

TORCH_LIBRARY_IMPL(headwise, CPU, m) { m.impl("watch_ends", &watch_ends); }
TORCH_LIBRARY_IMPL(headwise, CompositeExplicitAutograd, m) {
  m.impl("watch_forget", &watch_forget);
  m.impl("watched_changed", &watched_changed);
}
