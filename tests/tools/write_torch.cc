// write_torch: renders a LazyTorchFile described by a JSON spec into a real file, so end-to-end
// tests can torch.load what the writer produces.
//
//   write_torch [--no-floats] [--chunk N] [--sparse] [--prefix P] [--alignment A] SPEC.json OUT.pt
//
// SPEC values:
//   {"type":"none"} {"type":"bool","value":true} {"type":"int","value":N}
//   {"type":"float","value":x} {"type":"str","value":"..."}
//   {"type":"list","items":[v,...]} {"type":"tuple","items":[v,...]}
//   {"type":"dict","ordered":true|false,"items":[[key, v],...]}   key: JSON string or integer
//   {"type":"tensor","dtype":"bfloat16","shape":[2,3],"file":"raw.bin","offset":N}
// Tensor bytes are read (pread) from `file` at `offset` (numel * itemsize bytes, row-major);
// a relative `file` is relative to the spec's directory.
// The output is written by calling ReadAt in chunks of N bytes (default 1 MiB) to exercise
// chunked reads. --sparse leaves all-zero chunks as holes (for multi-GiB test files on small
// disks). --prefix / --alignment set SaveOptions. On success prints one JSON line: {"size":...,
// "records":[{"name", "lho", "data_offset", "n_bytes"},...]}. Errors go to stderr with a non-zero
// exit. Not for: production conversions (that is `ucpfs convert`).
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/checked.h"
#include "core/dtype.h"
#include "core/format/torch_writer.h"
#include "core/io/file_source.h"

namespace {

using ucpfs::Result;
using ucpfs::Status;
using ucpfs::format::SaveValue;
using json = nlohmann::json;

// Tensor bytes from a window of a raw file.
class FileWindowProvider final : public ucpfs::format::TensorBytesProvider {
 public:
  FileWindowProvider(std::shared_ptr<const ucpfs::FileSource> file, uint64_t byte_offset)
      : file_(std::move(file)), byte_offset_(byte_offset) {}
  Status Read(uint64_t byte_offset, std::span<std::byte> out) const override {
    return file_->ReadAt(byte_offset_ + byte_offset, out);
  }

 private:
  std::shared_ptr<const ucpfs::FileSource> file_;
  uint64_t byte_offset_;
};

class SpecParser {
 public:
  explicit SpecParser(std::filesystem::path base_dir) : base_dir_(std::move(base_dir)) {}

  Result<SaveValue> Parse(const json& j, const std::string& path) {
    if (!j.is_object() || !j.contains("type") || !j["type"].is_string()) {
      return ucpfs::InvalidArgumentError(path + ": expected an object with a string \"type\"");
    }
    const std::string type = j["type"];
    if (type == "none") return SaveValue::None();
    if (type == "bool") {
      if (!j.contains("value") || !j["value"].is_boolean())
        return Bad(path, "bool needs a boolean value");
      return SaveValue::Bool(j["value"].get<bool>());
    }
    if (type == "int") {
      if (!j.contains("value") || !j["value"].is_number_integer())
        return Bad(path, "int needs an integer value");
      if (j["value"].is_number_unsigned() && j["value"].get<uint64_t>() > INT64_MAX) {
        return Bad(path, "int value does not fit int64");
      }
      return SaveValue::Int(j["value"].get<int64_t>());
    }
    if (type == "float") {
      if (!j.contains("value") || !j["value"].is_number())
        return Bad(path, "float needs a number value");
      return SaveValue::Float(j["value"].get<double>());
    }
    if (type == "str") {
      if (!j.contains("value") || !j["value"].is_string())
        return Bad(path, "str needs a string value");
      return SaveValue::Str(j["value"].get<std::string>());
    }
    if (type == "list" || type == "tuple") {
      if (!j.contains("items") || !j["items"].is_array())
        return Bad(path, type + " needs an items array");
      std::vector<SaveValue> items;
      size_t i = 0;
      for (const json& item : j["items"]) {
        UCPFS_ASSIGN_OR_RETURN(SaveValue v, Parse(item, path + "[" + std::to_string(i++) + "]"));
        items.push_back(std::move(v));
      }
      return type == "list" ? SaveValue::List(std::move(items))
                            : SaveValue::Tuple(std::move(items));
    }
    if (type == "dict") {
      if (!j.contains("items") || !j["items"].is_array())
        return Bad(path, "dict needs an items array");
      SaveValue::DictItems items;
      size_t i = 0;
      for (const json& item : j["items"]) {
        const std::string child = path + "{" + std::to_string(i++) + "}";
        if (!item.is_array() || item.size() != 2)
          return Bad(child, "dict item must be [key, value]");
        SaveValue key;
        if (item[0].is_string()) {
          key = SaveValue::Str(item[0].get<std::string>());
        } else if (item[0].is_number_integer()) {
          key = SaveValue::Int(item[0].get<int64_t>());
        } else {
          UCPFS_ASSIGN_OR_RETURN(key, Parse(item[0], child + ".key"));
        }
        UCPFS_ASSIGN_OR_RETURN(SaveValue value, Parse(item[1], child));
        items.emplace_back(std::move(key), std::move(value));
      }
      const bool ordered = j.value("ordered", false);
      return ordered ? SaveValue::OrderedDict(std::move(items)) : SaveValue::Dict(std::move(items));
    }
    if (type == "tensor") return ParseTensor(j, path);
    return Bad(path, "unknown type '" + type + "'");
  }

 private:
  static Status Bad(const std::string& path, const std::string& why) {
    return ucpfs::InvalidArgumentError(path + ": " + why);
  }

  Result<SaveValue> ParseTensor(const json& j, const std::string& path) {
    if (!j.contains("dtype") || !j["dtype"].is_string()) return Bad(path, "tensor needs a dtype");
    auto dtype = ucpfs::DTypeFromTorchName(j["dtype"].get<std::string>());
    if (!dtype) return Bad(path, "unknown dtype '" + j["dtype"].get<std::string>() + "'");
    if (!j.contains("shape") || !j["shape"].is_array())
      return Bad(path, "tensor needs a shape array");
    std::vector<int64_t> shape;
    uint64_t numel = 1;
    for (const json& d : j["shape"]) {
      if (!d.is_number_integer() || d.get<int64_t>() < 0) return Bad(path, "bad dimension");
      shape.push_back(d.get<int64_t>());
      auto m = ucpfs::CheckedMul(numel, d.get<uint64_t>());
      if (!m) return Bad(path, "shape overflows");
      numel = *m;
    }
    auto n_bytes = ucpfs::CheckedMul(numel, ucpfs::ItemSize(*dtype));
    if (!n_bytes) return Bad(path, "tensor size overflows");
    std::shared_ptr<const ucpfs::format::TensorBytesProvider> provider;
    if (*n_bytes > 0) {
      if (!j.contains("file") || !j["file"].is_string()) return Bad(path, "tensor needs a file");
      const uint64_t offset = j.value("offset", uint64_t{0});
      std::filesystem::path file = j["file"].get<std::string>();
      if (file.is_relative()) file = base_dir_ / file;
      auto& src = files_[file.string()];
      if (!src) {
        UCPFS_ASSIGN_OR_RETURN(src, ucpfs::FileSource::Open(file.string()));
      }
      if (!ucpfs::RangeInside(offset, *n_bytes, src->Size())) {
        return Bad(path, "tensor bytes [" + std::to_string(offset) + ", +" +
                             std::to_string(*n_bytes) + ") are not inside " + file.string());
      }
      provider = std::make_shared<FileWindowProvider>(src, offset);
    }
    return SaveValue::Tensor(*dtype, std::move(shape), std::move(provider));
  }

  std::filesystem::path base_dir_;
  std::map<std::string, std::shared_ptr<const ucpfs::FileSource>> files_;
};

int Fail(const std::string& msg) {
  std::cerr << "write_torch: " << msg << "\n";
  return 1;
}

int Usage() {
  std::cerr << "usage: write_torch [--no-floats] [--chunk N] [--sparse] [--prefix P] "
               "[--alignment A] SPEC.json OUT.pt\n";
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  ucpfs::format::SaveOptions options;
  uint64_t chunk = 1 << 20;
  bool sparse = false;
  std::vector<std::string> positional;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto next = [&]() -> const char* { return i + 1 < argc ? argv[++i] : nullptr; };
    if (arg == "--no-floats") {
      options.allow_floats = false;
    } else if (arg == "--sparse") {
      sparse = true;
    } else if (arg == "--chunk" || arg == "--prefix" || arg == "--alignment") {
      const char* v = next();
      if (v == nullptr) return Usage();
      try {
        if (arg == "--chunk") chunk = std::stoull(v);
        if (arg == "--prefix") options.prefix = v;
        if (arg == "--alignment") options.alignment = static_cast<uint32_t>(std::stoul(v));
      } catch (const std::exception&) {
        return Fail("bad value for " + arg + ": " + v);
      }
    } else if (arg.starts_with("--")) {
      return Usage();
    } else {
      positional.push_back(arg);
    }
  }
  if (positional.size() != 2 || chunk == 0) return Usage();
  const std::string spec_path = positional[0];
  const std::string out_path = positional[1];

  json spec;
  {
    std::ifstream in(spec_path);
    if (!in) return Fail(spec_path + ": cannot open");
    try {
      in >> spec;
    } catch (const std::exception& e) {
      return Fail(spec_path + ": bad JSON: " + e.what());
    }
  }
  SpecParser parser(std::filesystem::path(spec_path).parent_path());
  auto root = parser.Parse(spec, "spec");
  if (!root.ok()) return Fail(root.error().ToString());
  auto file = ucpfs::format::LazyTorchFile::Build(*root, out_path, options);
  if (!file.ok()) return Fail(file.error().ToString());
  const ucpfs::format::LazyTorchFile& lazy = **file;

  const int fd = ::open(out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return Fail(out_path + ": open: " + std::strerror(errno));
  std::vector<std::byte> buf(static_cast<size_t>(std::min<uint64_t>(chunk, lazy.Size() + 1)));
  for (uint64_t offset = 0; offset < lazy.Size();) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(buf.size(), lazy.Size() - offset));
    Status st = lazy.ReadAt(offset, std::span<std::byte>(buf.data(), n));
    if (!st.ok()) {
      ::close(fd);
      return Fail(st.ToString());
    }
    if (sparse && std::all_of(buf.begin(), buf.begin() + static_cast<ptrdiff_t>(n),
                              [](std::byte b) { return b == std::byte{0}; })) {
      offset += n;  // a hole; ftruncate below sets the final size
      continue;
    }
    if (::lseek(fd, static_cast<off_t>(offset), SEEK_SET) < 0) {
      const std::string err = std::strerror(errno);
      ::close(fd);
      return Fail(out_path + ": lseek: " + err);
    }
    for (size_t done = 0; done < n;) {
      const ssize_t w = ::write(fd, buf.data() + done, n - done);
      if (w < 0) {
        if (errno == EINTR) continue;
        const std::string err = std::strerror(errno);
        ::close(fd);
        return Fail(out_path + ": write: " + err);
      }
      done += static_cast<size_t>(w);
    }
    offset += n;
  }
  if (::ftruncate(fd, static_cast<off_t>(lazy.Size())) != 0) {
    const std::string err = std::strerror(errno);
    ::close(fd);
    return Fail(out_path + ": ftruncate: " + err);
  }
  if (::close(fd) != 0) return Fail(out_path + ": close: " + std::strerror(errno));

  json report;
  report["size"] = lazy.Size();
  report["records"] = json::array();
  for (const auto& r : lazy.records()) {
    report["records"].push_back({{"name", r.name},
                                 {"lho", r.local_header_offset},
                                 {"data_offset", r.data_offset},
                                 {"n_bytes", r.n_bytes}});
  }
  std::cout << report.dump() << "\n";
  return 0;
}
