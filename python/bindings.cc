// ucpfs._core: the Python binding (nanobind) of the FUSE-free Filesystem, so `ucpfs.open(SRC)`
// serves the very namespace a mount shows, through the same code (index::OpenSnapshot,
// views::BuildNamespace, fs::Filesystem), with no kernel, no /dev/fuse and no privilege.
//
// Not for: the Python API's shape (python/ucpfs/views.py); mounting (the `ucpfs` binary).
//
// Also `Tensors`: every parameter of the source as consolidated tensors whose sub-boxes are read
// from the source alone (slice::ReadBoxBytes), for ucpfs.torch.StorageReader (python/ucpfs/torch.py).
//
// Invariants:
// - A Node is one reference to an inode (Filesystem::Lookup), given back when the Node dies
//   (Filesystem::Forget), so a target layout looked up is released as a mount's is once no Node
//   of it is alive.
// - Read-only: files are opened O_RDONLY; the source's own files are served by a Passthrough
//   with no write capture, and nothing here writes to them.
// - The GIL is released while the index is built and while a file is read, so Python threads
//   (a DataLoader's, torch.load's) read in parallel.
#include <Python.h>
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "core/status.h"
#include "fs/errno_map.h"
#include "fs/filesystem.h"
#include "fs/namespace.h"
#include "views/mount_views.h"
#include "fs/passthrough.h"
#include "index/catalog.h"
#include "index/snapshot.h"
#include "core/slice/local_view.h"
#include "views/target.h"
#include "views/view_inputs.h"

namespace nb = nanobind;

namespace ucpfs::python {
namespace {

// A Status as the Python exception the same failure would give through a mount: OSError with
// the errno the mount would reply (fs/errno_map.h' one rule), and the message naming the file.
[[noreturn]] void Raise(const Status& s) {
  const int err = fs::ErrnoFromStatus(s);
  nb::object exc = nb::borrow(err == ENOENT ? PyExc_FileNotFoundError
                              : err == EISDIR ? PyExc_IsADirectoryError
                              : err == ENOTDIR ? PyExc_NotADirectoryError
                              : err == EACCES || err == EPERM ? PyExc_PermissionError
                                                              : PyExc_OSError);
  PyErr_SetObject(exc.ptr(), nb::make_tuple(err, s.ToString()).ptr());
  throw nb::python_error();
}

template <typename T>
T Take(Result<T> r) {
  if (!r.ok()) Raise(r.error());
  return std::move(r).value();
}

// One opened source: its snapshot, the namespace built from it, and the Filesystem serving it.
struct Session {
  std::shared_ptr<const index::Snapshot> snapshot;
  std::unique_ptr<fs::Filesystem> filesystem;
  std::string source_dir;
  std::string index_dir;
  std::string index_state;
  std::string status_json;
  uint64_t fingerprint = 0;  // of the source's files when opened (the index's): a new one when they change
};

// `f()` with the GIL released (an index build, a layout build, a read), so other Python threads
// run meanwhile. `f` must not touch Python objects.
template <typename F>
auto WithoutGil(F f) {
  nb::gil_scoped_release unlocked;
  return f();
}

// Opens `src` as `ucpfs mount` would (one checkpoint; a run directory or a source with no
// checkpoint is refused): the index reused or built at `index_dir` ("": SRC/.ucpfs, or the
// user's cache when SRC is not writable), target/<layout> built on its first lookup.
Result<std::shared_ptr<Session>> MakeSession(const std::string& src, const std::string& index_dir,
                                             bool read_only_index, uint64_t lookup_memory_mib,
                                             uint64_t safetensors_shard_n_bytes, const std::string& rules) {
  index::SnapshotOptions o;
  char buf[PATH_MAX];
  o.source_dir = ::realpath(src.c_str(), buf) != nullptr ? std::string(buf) : src;
  o.index_dir = index_dir;
  o.read_only_index = read_only_index;
  if (!rules.empty()) {  // `ucpfs mount --rules FILE`: key naming rules
    UCPFS_ASSIGN_OR_RETURN(o.key_rules, index::LoadRules(rules));
  }
  UCPFS_ASSIGN_OR_RETURN(std::shared_ptr<const index::Snapshot> snapshot, index::OpenSnapshot(o, 1));
  views::ViewOptions targets;
  targets.lookup_budget_bytes = lookup_memory_mib << 20;
  targets.safetensors_shard_n_bytes = safetensors_shard_n_bytes;
  fs::NamespaceInfo info;
  UCPFS_ASSIGN_OR_RETURN(std::shared_ptr<fs::Tree> tree, views::BuildNamespace(snapshot, targets, fs::MountHooks{}, &info));
  // The source's own files beside the views, as the mount shows them; no write capture.
  UCPFS_ASSIGN_OR_RETURN(std::unique_ptr<fs::Passthrough> passthrough, fs::Passthrough::Make(o.source_dir, nullptr));
  fs::FilesystemOptions fo;
  fo.uid = ::getuid();
  fo.gid = ::getgid();
  fo.dynamic_dir = info.target_dir;
  fo.resolve = info.resolve_target;
  fo.list = info.list_target;
  fo.passthrough = std::move(passthrough);
  auto session = std::make_shared<Session>();
  UCPFS_ASSIGN_OR_RETURN(session->filesystem, fs::Filesystem::Make(std::move(tree), std::move(fo)));
  session->snapshot = snapshot;
  session->source_dir = o.source_dir;
  session->index_dir = snapshot->opened.index_dir;
  session->index_state = index::IndexStateName(snapshot->opened.state);
  session->status_json = info.status_json;
  session->fingerprint = snapshot->opened.fingerprint;
  return session;
}

std::shared_ptr<Session> OpenSession(const std::string& src, const std::string& index_dir, bool read_only_index,
                                     uint64_t lookup_memory_mib, uint64_t safetensors_shard_n_bytes,
                                     const std::string& rules) {
  return Take(WithoutGil([&] {
    return MakeSession(src, index_dir, read_only_index, lookup_memory_mib, safetensors_shard_n_bytes, rules);
  }));
}

// One open(2) of a file: reads at any offset, from any thread.
class Handle {
 public:
  Handle(std::shared_ptr<Session> session, fs::OpenFile file, uint64_t n_bytes)
      : session_(std::move(session)), file_(std::move(file)), n_bytes_(n_bytes) {}
  ~Handle() { (void)session_->filesystem->Release(file_); }
  uint64_t size() const { return n_bytes_; }

  // Fills the writable buffer `buffer` (bytearray, memoryview, numpy array...) from
  // `byte_offset`; returns how many bytes were read (fewer only at the end of the file).
  size_t ReadInto(uint64_t byte_offset, nb::handle buffer) {
    Py_buffer view;
    if (PyObject_GetBuffer(buffer.ptr(), &view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) != 0) throw nb::python_error();
    std::span<std::byte> out(static_cast<std::byte*>(view.buf), static_cast<size_t>(view.len));
    size_t done = 0;
    Status failed = Status::Ok();
    {
      nb::gil_scoped_release unlocked;
      // Filesystem::Read answers at most what one source read gives; a short count before the
      // end of the file is asked again, as the kernel would.
      while (done < out.size() && byte_offset + done < n_bytes_) {
        auto n = session_->filesystem->Read(file_, byte_offset + done, out.subspan(done));
        if (!n.ok()) {
          failed = n.error();
          break;
        }
        if (*n == 0) break;
        done += *n;
      }
    }
    PyBuffer_Release(&view);
    if (!failed.ok()) Raise(failed);
    return done;
  }

 private:
  std::shared_ptr<Session> session_;
  fs::OpenFile file_;
  uint64_t n_bytes_;
};

// One node of the namespace, holding one reference to its inode.
class Node {
 public:
  Node(std::shared_ptr<Session> session, fs::Ino ino, bool counted)
      : session_(std::move(session)), ino_(ino), counted_(counted) {}
  Node(const Node&) = delete;
  Node& operator=(const Node&) = delete;
  ~Node() {
    if (counted_) session_->filesystem->Forget(ino_, 1);
  }

  static std::shared_ptr<Node> Root(std::shared_ptr<Session> session) {
    return std::make_shared<Node>(std::move(session), fs::kRootIno, false);
  }

  // The child `name`. Errors: FileNotFoundError (for target/<layout>, naming why a layout is
  // refused when it is), NotADirectoryError.
  std::shared_ptr<Node> Child(const std::string& name) const {
    // A layout may be built now.
    fs::Entry e = Take(WithoutGil([&] { return session_->filesystem->Lookup(ino_, name); }));
    if (e.ino == 0) Raise(NotFoundError(session_->filesystem->PathOf(ino_) + "/" + name + ": no such file"));
    return std::make_shared<Node>(session_, e.ino, true);
  }

  // The names it lists, as readdir shows them (without "." and "..").
  std::vector<std::string> List() const {
    fs::DirListing listing = Take(session_->filesystem->OpenDir(ino_));
    std::vector<std::string> names;
    for (const auto& item : listing.items) {
      if (item.name != "." && item.name != "..") names.push_back(item.name);
    }
    return names;
  }

  // (st_mode, st_size, st_mtime) as stat(2) through a mount shows them.
  std::vector<int64_t> Stat() const {
    const struct stat st = Take(session_->filesystem->GetAttr(ino_));
    return {static_cast<int64_t>(st.st_mode), static_cast<int64_t>(st.st_size), static_cast<int64_t>(st.st_mtime)};
  }

  bool IsSource() const { return fs::Passthrough::Owns(ino_); }
  std::string Path() const { return session_->filesystem->PathOf(ino_); }

  std::shared_ptr<Handle> Open() const {
    // A target rank file is built again here.
    fs::OpenFile file = Take(WithoutGil([&] { return session_->filesystem->Open(ino_, O_RDONLY); }));
    uint64_t n_bytes = file.n_bytes;
    if (file.passthrough) {  // a source file: its size now (OpenFile::n_bytes is unused)
      const struct stat st = Take(session_->filesystem->GetAttr(ino_));
      n_bytes = static_cast<uint64_t>(st.st_size);
    }
    return std::make_shared<Handle>(session_, std::move(file), n_bytes);
  }

 private:
  std::shared_ptr<Session> session_;
  fs::Ino ino_;
  bool counted_;
};

// A plain value of the source (an optimizer hyper-parameter, a model's extra state) as the
// Python object torch.load would give; false (and `out` unset) for a tensor, class or object.
bool ToPython(const format::SaveValue& v, nb::object* out) {
  using K = format::SaveValue::Kind;
  switch (v.kind()) {
    case K::kNone: *out = nb::none(); return true;
    case K::kBool: *out = nb::bool_(v.bool_value()); return true;
    case K::kInt: *out = nb::int_(v.int_value()); return true;
    case K::kFloat: *out = nb::float_(v.float_value()); return true;
    case K::kString: *out = nb::str(v.string_value().data(), v.string_value().size()); return true;
    case K::kBytes: *out = nb::bytes(v.string_value().data(), v.string_value().size()); return true;
    case K::kList:
    case K::kTuple: {
      nb::list items;
      for (const auto& item : v.items()) {
        nb::object o;
        if (!ToPython(item, &o)) return false;
        items.append(o);
      }
      *out = v.kind() == K::kList ? nb::object(items) : nb::steal(PySequence_Tuple(items.ptr()));
      return true;
    }
    case K::kDict: {
      nb::dict d;
      for (const auto& [key, value] : v.dict_items()) {
        nb::object k, o;
        if (!ToPython(key, &k) || !ToPython(value, &o)) return false;
        d[k] = o;
      }
      *out = d;
      return true;
    }
    default: return false;
  }
}

std::optional<views::TargetState> StateNamed(const std::string& name) {
  for (int s = 0; s < views::kNumTargetStates; ++s) {
    if (name == views::TargetStateName(static_cast<views::TargetState>(s))) return static_cast<views::TargetState>(s);
  }
  return std::nullopt;
}

// Every parameter of the source as consolidated tensors (the target views' input: each state's
// global layout over the source's fragments), for ucpfs.torch.StorageReader: it lists them and
// reads any sub-box of one, reading from the source only the bytes inside that box.
class Tensors {
 public:
  explicit Tensors(std::shared_ptr<Session> session) : session_(std::move(session)) {
    const index::Snapshot& snap = *session_->snapshot;
    input_ = Take(WithoutGil([&] {
      return index::MakeTargetInput(snap.checkpoint(), session_->snapshot, snap.mapping, snap.files,
                                    [&](const std::string& w) { warnings_.push_back(w); });
    }));
  }

  // One dict per parameter, in the source's order: name, in_model, in_optimizer, group (the
  // source's param group, -1 unknown), shape, states {state: torch dtype name}, step_value (the
  // step stored as a number, else None), hyper [(field, value)] and model_siblings [(name,
  // value)] (values a model's state_dict holds beside the parameter: Megatron-Core's
  // `_extra_state`); a value that is not plain data is left out, with a warning.
  nb::list Params() {
    nb::list out;
    for (const auto& p : input_->params) {
      nb::dict d;
      d["name"] = p.name;
      d["in_model"] = p.in_model;
      d["in_optimizer"] = p.in_optimizer;
      d["group"] = p.group;
      nb::dict states;
      nb::object shape = nb::none();
      for (int s = 0; s < views::kNumTargetStates; ++s) {
        const auto& layout = p.states[s];
        if (!layout) continue;
        const auto state = static_cast<views::TargetState>(s);
        states[views::TargetStateName(state)] = std::string(TorchName(p.dtypes[s]));
        if (state != views::TargetState::kStep && shape.is_none()) shape = nb::cast(layout->shape);
      }
      d["states"] = states;
      d["shape"] = shape;
      d["step_value"] = p.step_value ? nb::object(nb::float_(*p.step_value)) : nb::none();
      d["hyper"] = PlainPairs(p.hyper, p.name + ": hyper-parameter '");
      d["model_siblings"] = PlainPairs(p.model_siblings, p.name + ": model value '");
      out.append(d);
    }
    return out;
  }

  // [(name, value)] of the pairs whose value is plain data; a warning for each other one.
  nb::list PlainPairs(const std::vector<std::pair<std::string, format::SaveValue>>& pairs, const std::string& what) {
    nb::list out;
    for (const auto& [name, value] : pairs) {
      nb::object o;
      if (ToPython(value, &o)) {
        out.append(nb::make_tuple(name, o));
      } else {
        warnings_.push_back(what + name + "' is not plain data: not served");
      }
    }
    return out;
  }

  // Reads the box (offsets, sizes) of parameter `index`'s `state` in dtype `dtype` (a torch
  // name) into the writable C-contiguous `buffer`, which must hold exactly its bytes.
  // Errors: ValueError (no such parameter or state, unknown dtype); OSError from the read.
  void ReadBox(size_t index, const std::string& state, const std::vector<int64_t>& offsets,
               const std::vector<int64_t>& sizes, const std::string& dtype, nb::handle buffer) const {
    if (index >= input_->params.size()) throw nb::value_error("no such parameter");
    const auto s = StateNamed(state);
    const auto dst = DTypeFromTorchName(dtype);
    if (!s || !dst) throw nb::value_error(("unknown state or dtype: " + state + ", " + dtype).c_str());
    const auto& layout = input_->params[index].states[static_cast<int>(*s)];
    if (!layout) throw nb::value_error((input_->params[index].name + " has no " + state).c_str());
    Py_buffer view;
    if (PyObject_GetBuffer(buffer.ptr(), &view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) != 0) throw nb::python_error();
    std::span<std::byte> out(static_cast<std::byte*>(view.buf), static_cast<size_t>(view.len));
    Status read = Status::Ok();
    {
      nb::gil_scoped_release unlocked;
      read = slice::ReadBoxBytes(*layout, slice::Box{offsets, sizes}, *dst, *input_->files, out);
    }
    PyBuffer_Release(&view);
    if (!read.ok()) {
      Raise(read.WithContext(input_->params[index].name + " " + state));
    }
  }

  // The shape of parameter `index`'s step tensor (one element). Errors: ValueError (none).
  std::vector<int64_t> StepShape(size_t index) const {
    if (index >= input_->params.size()) throw nb::value_error("no such parameter");
    const auto& step = input_->params[index].states[static_cast<int>(views::TargetState::kStep)];
    if (!step) throw nb::value_error((input_->params[index].name + " has no step tensor").c_str());
    return step->shape;
  }

  std::vector<std::string> Warnings() const { return warnings_; }
  std::vector<std::string> NotServed() const {
    std::vector<std::string> out;
    for (const auto& n : input_->not_served) out.push_back(n.key + ": " + n.reason);
    return out;
  }

 private:
  std::shared_ptr<Session> session_;
  std::shared_ptr<const views::TargetInput> input_;
  std::vector<std::string> warnings_;
};

}  // namespace
}  // namespace ucpfs::python

NB_MODULE(_core, m) {
  using namespace ucpfs::python;
  m.doc() = "ucpfs core: the mount's namespace without FUSE (use the `ucpfs` package, not this module)";
  // Objects still referenced at interpreter exit (by a traceback, a module global) are not
  // leaks of ours; nanobind would list each on stderr.
  nb::set_leak_warnings(false);
  nb::class_<Session>(m, "Session")
      .def_ro("source_dir", &Session::source_dir)
      .def_ro("index_dir", &Session::index_dir)
      .def_ro("index_state", &Session::index_state)
      .def_ro("status_json", &Session::status_json)
      .def_ro("fingerprint", &Session::fingerprint)
      .def_prop_ro("source_bytes_read",
                   [](const Session& s) { return s.snapshot->counters->source_bytes_read.load(); })
      .def("root", [](std::shared_ptr<Session> s) { return Node::Root(std::move(s)); });
  nb::class_<Node>(m, "Node")
      .def("child", &Node::Child, nb::arg("name"))
      .def("list", &Node::List)
      .def("stat", &Node::Stat)
      .def("open", &Node::Open)
      .def_prop_ro("is_source", &Node::IsSource)
      .def_prop_ro("path", &Node::Path);
  nb::class_<Handle>(m, "Handle")
      .def_prop_ro("size", &Handle::size)
      .def("readinto", &Handle::ReadInto, nb::arg("byte_offset"), nb::arg("buffer"));
  nb::class_<Tensors>(m, "Tensors")
      .def(nb::init<std::shared_ptr<Session>>(), nb::arg("session"))
      .def("params", &Tensors::Params)
      .def("read_box", &Tensors::ReadBox, nb::arg("index"), nb::arg("state"), nb::arg("offsets"), nb::arg("sizes"),
           nb::arg("dtype"), nb::arg("buffer"))
      .def("step_shape", &Tensors::StepShape, nb::arg("index"))
      .def_prop_ro("warnings", &Tensors::Warnings)
      .def_prop_ro("not_served", &Tensors::NotServed);
  m.def("open_session", &OpenSession, nb::arg("src"), nb::arg("index_dir") = "", nb::arg("read_only_index") = false,
        nb::arg("lookup_memory_mib") = 256, nb::arg("safetensors_shard_n_bytes") = 5'000'000'000ULL,
        nb::arg("rules") = "");
  m.def("cache_index_dir", &ucpfs::index::CacheIndexDir, nb::arg("src"),
        "the index directory used for SRC when SRC/.ucpfs cannot be created");
}
