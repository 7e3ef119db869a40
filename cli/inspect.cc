#include "cli/inspect.h"
#include "core/json_text.h"

#include <iomanip>
#include <nlohmann/json.hpp>
#include <ostream>
#include <sstream>

#include "cli/text.h"
#include "core/format/torch_file.h"
#include "core/io/file_source.h"

namespace ucpfs::cli {
namespace {

void PrintJson(const std::string& path, const format::TorchFile& f, std::ostream& out) {
  nlohmann::ordered_json j;
  j["format"] = f.legacy() ? "torch.save (legacy)" : "torch.save";
  j["path"] = path;
  j["size"] = f.source().Size();
  auto tensors = nlohmann::ordered_json::array();
  for (const auto& t : f.tensors()) {
    nlohmann::ordered_json e;
    e["key"] = t.key;
    e["dtype"] = std::string(TorchName(t.dtype));
    e["shape"] = t.shape;
    e["stride"] = t.stride;
    e["storage_offset"] = t.storage_offset;
    e["storage_key"] = t.storage_key;
    e["data_offset"] = t.data_offset;
    e["nbytes"] = t.n_bytes;
    tensors.push_back(std::move(e));
  }
  j["tensors"] = std::move(tensors);
  out << JsonText(j) << '\n';
}

void PrintTable(const std::string& path, const format::TorchFile& f, std::ostream& out) {
  uint64_t total = 0;
  for (const auto& t : f.tensors()) total += t.n_bytes;
  out << path << (f.legacy() ? ": torch.save (legacy format), " : ": torch.save, ") << f.source().Size()
      << " bytes, " << f.tensors().size() << " tensors, " << HumanBytes(total) << " of tensor data\n";
  if (f.tensors().empty()) return;
  size_t key_w = 3;
  for (const auto& t : f.tensors()) key_w = std::max(key_w, t.key.size());
  key_w = std::min<size_t>(key_w, 60);
  out << std::left << std::setw(static_cast<int>(key_w)) << "key" << "  " << std::setw(13) << "dtype"
      << std::setw(20) << "shape" << std::setw(16) << "stride" << std::setw(8) << "storage"
      << std::right << std::setw(14) << "data_offset" << std::setw(14) << "nbytes" << '\n';
  for (const auto& t : f.tensors()) {
    std::string stride = Dims(t.stride) + (t.contiguous ? "" : "*");
    std::string storage = t.storage_key + (t.storage_offset ? "+" + std::to_string(t.storage_offset) : "");
    out << std::left << std::setw(static_cast<int>(key_w)) << t.key << "  " << std::setw(13)
        << TorchName(t.dtype) << std::setw(20) << Dims(t.shape) << std::setw(16) << stride
        << std::setw(8) << storage << std::right << std::setw(14) << t.data_offset
        << std::setw(14) << t.n_bytes << '\n';
  }
  out << "(* = not contiguous: elements are strided inside their storage)\n";
}

}  // namespace

int RunInspect(const std::string& path, bool json, std::ostream& out, std::ostream& err) {
  auto src = FileSource::Open(path);
  if (!src.ok()) {
    err << "ucpfs inspect: " << src.error().ToString() << '\n';
    return 1;
  }
  auto file = format::TorchFile::Open(*src);
  if (!file.ok()) {
    err << "ucpfs inspect: " << file.error().ToString() << '\n';
    return 1;
  }
  if (json) PrintJson(path, *file, out);
  else PrintTable(path, *file, out);
  return 0;
}

}  // namespace ucpfs::cli
