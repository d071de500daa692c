// Whether any tensor of a few modules changed since the last time it was asked: headwise.linear.weight_cache.Seen, which
// a layer's one-op decode step (headwise.models.native_layer) asks every step before it reuses the arguments it made;
// and, below, whether a model's modules may run unchecked and are the ones they were (headwise.models.generate.Walk,
// asked after every on_token and every Batcher step: a Llama's 150 modules' dictionaries read from Python took 0.24 ms).
// From Python the same answer was the `state` tuple of each of the layer's tensors (a Llama layer's 23): some 40 µs a
// layer, most of it dependent cache misses (the module's dictionary, the tensor object, its TensorImpl, its storage, its
// version counter) paid one after another by the interpreter. Here one call walks the modules' dictionaries and the
// tensors' fields in C++.
//
// A tensor's state is what weight_cache.state compares: its TensorImpl (held by a weak reference, so that no other
// tensor can take its address while the state lives: a weight replaced is never mistaken for the old one), its data
// pointer, version, dtype, sizes and strides. A .data write that left all of that as it was is seen by weight_cache's
// samples, which move a number the caller passes (`epoch`). A tensor without a plain strided CPU-or-device storage (a
// tensor subclass, a sparse or an inference tensor) is never the same: the caller asks afresh every time.
//
// Called through ctypes with the GIL held (ctypes.PyDLL): the table needs no lock of its own, and the finalizer that
// forgets a key runs under the GIL too. Nothing here throws into ctypes: an error is an answer of "changed".
#include <Python.h>

#include <ATen/ATen.h>
#include <c10/core/TensorImpl.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cstdint>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

namespace {

using WeakImpl = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;

// What was seen under one key: every tensor's fields side by side (compared with one memcmp) and weak references to
// their TensorImpls (their addresses are in the fields).
struct Seen {
  std::vector<int64_t> fields;
  std::vector<WeakImpl> held;
};

std::unordered_map<int64_t, Seen> table;

// New references to the Python objects a call reads (dictionaries, tensors, modules), dropped when it ends however it
// ends: a getattr or an isinstance that runs Python code cannot free one under it.
struct Held {
  std::vector<PyObject*> objects;
  ~Held() {
    for (PyObject* o : objects) Py_DECREF(o);
  }
};

// t's fields appended to out; false where t has no state that tells every change (then it is never the same).
bool add_fields(c10::TensorImpl& t, std::vector<int64_t>& out) {
  if (t.is_python_dispatch() || t.layout() != c10::kStrided || !t.has_storage() || !t.dtype_initialized()
      || t.has_symbolic_sizes_strides() || t.is_inference()) {
    return false;
  }
  const c10::Storage& storage = t.unsafe_storage();
  const auto* data = static_cast<const char*>(storage.unsafeGetStorageImpl()->data_ptr().get());
  out.push_back(reinterpret_cast<int64_t>(&t));
  out.push_back(reinterpret_cast<int64_t>(data) + t.storage_offset() * static_cast<int64_t>(t.itemsize()));
  out.push_back(static_cast<int64_t>(t.version_counter().current_version()));
  out.push_back(static_cast<int64_t>(t.dtype().toScalarType()));
  out.push_back(static_cast<int64_t>(t.device().type()) << 16 | static_cast<uint16_t>(t.device().index()));
  const auto sizes = t.sizes();
  const auto strides = t.strides();
  out.push_back(static_cast<int64_t>(sizes.size()));
  out.insert(out.end(), sizes.begin(), sizes.end());
  out.insert(out.end(), strides.begin(), strides.end());
  return true;
}

// Every value of `module`'s own dictionary `name` ("_parameters" or "_buffers") appended to values (held), Nones
// passed by; false where the module has no such dictionary.
bool add_values(PyObject* module, PyObject* name, std::vector<PyObject*>& values, Held& held) {
  PyObject* dict = PyObject_GetAttr(module, name);  // (a new reference)
  if (dict == nullptr || !PyDict_Check(dict)) {
    Py_XDECREF(dict);
    return false;
  }
  Py_ssize_t pos = 0;
  PyObject *key, *value;
  while (PyDict_Next(dict, &pos, &key, &value)) {
    if (value == Py_None) continue;
    Py_INCREF(value);  // (each tensor object asked for before any of its fields is read: the misses overlap)
    held.objects.push_back(value);
    values.push_back(value);
  }
  Py_DECREF(dict);
  return true;
}

PyObject* interned(const char* s) { return PyUnicode_InternFromString(s); }  // (kept for the process)

}  // namespace

// 1 where every tensor of the modules in `modules` (a tuple; each module's _parameters and _buffers) has the state it had
// at the last call with `key` and `epoch` equals that call's; else 0, with the new state kept under `key`.
extern "C" int headwise_seen_same(int64_t key, PyObject* modules, int64_t epoch) {
  static PyObject* const parameters = interned("_parameters");
  static PyObject* const buffers = interned("_buffers");
  try {
    if (!PyTuple_Check(modules)) return 0;
    Held held;
    std::vector<PyObject*> values;
    bool ok = true;
    for (Py_ssize_t i = 0; ok && i < PyTuple_GET_SIZE(modules); ++i) {
      PyObject* module = PyTuple_GET_ITEM(modules, i);
      ok = add_values(module, parameters, values, held) && add_values(module, buffers, values, held);
    }
    // The tensors' fields are read in passes, each asking for the next level's lines of every tensor before reading
    // any: a step that streamed the weights left none of them in the caches, and a chain of misses a tensor, paid one
    // tensor after another, cost more than the rest of the call.
    std::vector<c10::TensorImpl*> impls;
    impls.reserve(values.size());
    for (PyObject* value : values) {
      if (!ok || !THPVariable_Check(value)) {
        ok = false;
        break;
      }
      c10::TensorImpl* t = THPVariable_Unpack(value).unsafeGetTensorImpl();
      __builtin_prefetch(t);
      __builtin_prefetch(reinterpret_cast<const char*>(t) + 64);
      __builtin_prefetch(reinterpret_cast<const char*>(t) + 128);
      impls.push_back(t);
    }
    for (c10::TensorImpl* t : impls) {
      if (!ok) break;
      if (t->has_storage()) __builtin_prefetch(t->unsafe_storage().unsafeGetStorageImpl());
    }
    std::vector<int64_t> fields{epoch};
    fields.reserve(1 + 8 * impls.size());
    for (c10::TensorImpl* t : impls) {
      if (!ok) break;
      ok = add_fields(*t, fields);
    }
    if (PyErr_Occurred()) PyErr_Clear();
    if (!ok) {
      table.erase(key);
      return 0;
    }
    Seen& seen = table[key];
    if (seen.fields == fields) return 1;
    seen.fields = std::move(fields);
    seen.held.clear();
    for (c10::TensorImpl* t : impls) {
      seen.held.emplace_back(c10::intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>::unsafe_reclaim_from_nonowning(t));
    }
    return 0;
  } catch (...) {
    if (PyErr_Occurred()) PyErr_Clear();
    table.erase(key);
    return 0;
  }
}

// What was kept under `key` dropped (its weak references with it).
extern "C" void headwise_seen_forget(int64_t key) {
  try {
    table.erase(key);
  } catch (...) {
  }
}

namespace {

// key -> the walk's record: each module and its class, then its attributes' names and values, in the walk's order, every
// object held (a new reference: nothing else can take a remembered address while it is remembered)
std::unordered_map<int64_t, std::vector<PyObject*>> walks;

// Whether an attribute's value is compared by value: an int, a bool, a float, a str or None (a window, a softcap, a
// norm's eps, a GELU's approximate); any other value (a rotary table's object, a dictionary) by identity.
bool is_plain(PyObject* value) {
  return value == Py_None || PyLong_CheckExact(value) || PyBool_Check(value) || PyFloat_CheckExact(value)
         || PyUnicode_CheckExact(value);
}

// Whether two records hold the same objects, or equal plain values, in the same order (a NaN is never the same).
bool same(const std::vector<PyObject*>& a, const std::vector<PyObject*>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i] == b[i]) continue;
    if (!is_plain(a[i]) || Py_TYPE(a[i]) != Py_TYPE(b[i]) || PyObject_RichCompareBool(a[i], b[i], Py_EQ) != 1) {
      if (PyErr_Occurred()) PyErr_Clear();
      return false;
    }
  }
  return true;
}

// Forget the record under key, its objects let go.
void forget_walk(int64_t key) {
  auto it = walks.find(key);
  if (it == walks.end()) return;
  std::vector<PyObject*> objects = std::move(it->second);
  walks.erase(it);
  for (PyObject* o : objects) Py_DECREF(o);  // (after the erase: a finalizer that runs here finds the table whole)
}

// Whether PyObject_IsTrue(getattr(m, name)): 1, 0, or -1 where it cannot be read (an error set).
int truthy(PyObject* m, PyObject* name) {
  PyObject* value = PyObject_GetAttr(m, name);
  if (value == nullptr) return -1;
  const int answer = PyObject_IsTrue(value);
  Py_DECREF(value);
  return answer;
}

}  // namespace

// headwise.models.generate.walked's walk in one call: every module of `model`'s tree once (itself first, then depth
// first, children in their registration order pushed and taken last first, as the Python walk does), each asked whether
// it is in eval mode with no forward hooks and its class's own forward. -1 where one is not (or a field cannot be read);
// else 1 where the modules are, in that order, the ones of the last call under `key`, of the same classes, with the
// same attributes (names; values equal where `is_plain`, else the same objects), 0 where they are not (kept now). A
// negative key keeps nothing (1 for a model the steps may run unchecked).
extern "C" int headwise_walk(int64_t key, PyObject* model) {
  static PyObject* const training = interned("training");
  static PyObject* const hooks = interned("_forward_hooks");
  static PyObject* const pre_hooks = interned("_forward_pre_hooks");
  static PyObject* const modules = interned("_modules");
  static PyObject* const forward = interned("forward");
  try {
    Held held;
    std::vector<PyObject*> todo{model}, order;
    std::unordered_set<PyObject*> met{model};
    bool plain = true;
    while (plain && !todo.empty()) {
      PyObject* m = todo.back();
      todo.pop_back();
      PyObject* own = PyObject_GenericGetDict(m, nullptr);  // (a new reference)
      if (own == nullptr) {
        plain = false;
        break;
      }
      held.objects.push_back(own);
      plain = truthy(m, training) == 0 && truthy(m, hooks) == 0 && truthy(m, pre_hooks) == 0
              && PyDict_Check(own) && PyDict_Contains(own, forward) == 0;
      if (!plain) break;
      order.push_back(m);
      if (key >= 0) order.push_back(reinterpret_cast<PyObject*>(Py_TYPE(m)));  // (a class set on the module: another)
      Py_ssize_t at = 0;
      PyObject *field, *value;
      while (key >= 0 && PyDict_Next(own, &at, &field, &value)) {  // (nothing to compare with under a negative key)
        Py_INCREF(field);  // (held while the walk may still read them)
        Py_INCREF(value);
        held.objects.push_back(field);
        held.objects.push_back(value);
        order.push_back(field);
        order.push_back(value);
      }
      PyObject* children = PyObject_GetAttr(m, modules);
      if (children == nullptr || !PyDict_Check(children)) {
        Py_XDECREF(children);
        plain = false;
        break;
      }
      held.objects.push_back(children);
      Py_ssize_t pos = 0;
      PyObject *name, *child;
      while (PyDict_Next(children, &pos, &name, &child)) {
        if (child == Py_None || !met.insert(child).second) continue;
        Py_INCREF(child);  // (held while the walk may still read it)
        held.objects.push_back(child);
        todo.push_back(child);
      }
    }
    if (PyErr_Occurred()) PyErr_Clear();
    if (!plain) {
      if (key >= 0) forget_walk(key);
      return -1;
    }
    if (key < 0) return 1;
    auto it = walks.find(key);
    if (it != walks.end() && same(it->second, order)) return 1;
    for (PyObject* o : order) Py_INCREF(o);  // (before the old record's objects go: some may be the same ones)
    forget_walk(key);
    walks.emplace(key, std::move(order));
    return 0;
  } catch (...) {
    if (PyErr_Occurred()) PyErr_Clear();
    if (key >= 0) forget_walk(key);
    return -1;
  }
}

extern "C" void headwise_walk_forget(int64_t key) {
  try {
    forget_walk(key);
  } catch (...) {
  }
}
