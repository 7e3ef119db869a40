// LazyTorchFile: a virtual torch.save file synthesized from a description of the object
// (nested dicts / OrderedDicts / lists / tuples, ints, strings, bytes, bools, None, floats and
// tensor placeholders). Build() computes the exact size and every non-tensor byte (zip headers,
// data.pkl, version, byteorder, ...) without touching tensor data; ReadAt() then serves any
// byte range, filling tensor bytes from each tensor's TensorBytesProvider.
//
// Not for: reading torch files (zip_reader.h, pickle.h), views that share a storage, tensors
// that are not contiguous, quantized tensors, or Parameters. Instances of other classes are
// only re-emitted as a source pickle built them (SaveValue::Global/Object).
//
// Layout (what torch 2.x's torch.save emits through PyTorchStreamWriter + miniz; torch 1.13
// loads it too). Records, in this order, under "<prefix>/":
//   data.pkl, .format_version ("1"), .storage_alignment (the alignment, decimal), byteorder
//   ("little"), data/0 .. data/N-1 (contiguous, in key order), version ("3\n"),
//   .data/serialization_id (40 ASCII digits: deterministic hashes of the record names and
//   sizes and of the pickle; torch only logs it).
// Every record is STORED (method 0). Each local header carries an "FB" extra field padding the
// record's data to the alignment (always present, even with 0 bytes of padding), preceded by a
// ZIP64 extra {usize, csize} when the record has >= 0xFFFFFFFF bytes and {lho} when its local
// header starts at >= 0xFFFFFFFF. Non-empty records have flags 0x0808 and a data descriptor
// (24 bytes when ZIP64 applies, else 16); 0-byte records have flags 0x0800 and no descriptor.
// Then the central directory (ZIP64 extras for saturated fields), a ZIP64 EOCD, a ZIP64 EOCD
// locator and the EOCD, always all three.
//
// Tensors: each tensor placeholder gets its own storage; storage keys are numbered in order
// of first use in the pickle, so with contiguous records torch 2.x's computed-offset loading
// (`calculate_storage_offsets`, mmap) finds every storage. storage_offset is 0, strides are
// contiguous row-major, requires_grad is False, backward_hooks is OrderedDict(), location is
// 'cpu'. A tensor's record holds numel * ItemSize(dtype) bytes of its row-major data.
//
// Caveats (documented behaviour, not bugs):
//  - CRC-32. The small in-memory records (data.pkl, version, ...) carry their real CRC-32.
//    Tensor records carry CRC 0 in the data descriptor and the central directory: a real CRC
//    would need every tensor byte before the central directory could be served. torch never
//    checks CRCs (PyTorch builds miniz with MINIZ_DISABLE_ZIP_READER_CRC32_CHECKS), but
//    `unzip -t` and Python's zipfile.testzip() / ZipFile.read() report CRC errors on the
//    tensor records.
//  - Floats are pickled as BINFLOAT. torch 1.13's weights_only=True unpickler rejects that
//    opcode ("Unsupported operand 71"); torch 1.13 with weights_only=False and torch >= 2.6
//    (weights_only=True by default) accept it. SaveOptions::allow_floats = false makes Build
//    refuse floats, for files that must load with torch 1.13 weights_only=True.
//  - dtypes without a legacy typed-storage class (float8_*, uint16/32/64, complex32) are
//    written as torch 2.x does: `torch.storage UntypedStorage` with numel in bytes and
//    `torch._utils _rebuild_tensor_v3` with the dtype as GLOBAL 'torch <name>'. torch 1.13
//    cannot load those tensors. Quantized dtypes are refused (kUnsupported).
//  - Everything else uses only the pickle opcodes (protocol 2; BINUNICODE, never
//    SHORT_BINUNICODE; no memo) and globals (collections.OrderedDict,
//    torch._utils._rebuild_tensor_v2, torch.<X>Storage) that the weights_only unpicklers of
//    torch 1.13 and torch >= 2.6 both accept.
//
// Invariants: Size() and every header byte depend only on the description, never on tensor
// data; all size arithmetic is overflow-checked, so the layout of a multi-TiB file is computed
// without data. A LazyTorchFile is immutable after Build; ReadAt is thread-safe when the
// providers are. Memory held: the pickle and headers (O(number of tensors + description)).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "core/byte_source.h"
#include "core/dtype.h"
#include "core/status.h"

namespace ucpfs::format {

// Supplies a tensor's contiguous row-major bytes.
class TensorBytesProvider {
 public:
  virtual ~TensorBytesProvider() = default;
  // Fills `out` with the bytes at [byte_offset, byte_offset + out.size()) of the tensor's data.
  // LazyTorchFile only asks for ranges inside [0, numel * ItemSize(dtype)). Any non-ok Status
  // fails the whole ReadAt that needed it (no partial success).
  virtual Status Read(uint64_t byte_offset, std::span<std::byte> out) const = 0;
  // A hint that [byte_offset, byte_offset + n_bytes) will be read soon (ByteSource::Prefetch).
  virtual void Prefetch(uint64_t byte_offset, uint64_t n_bytes) const {
    (void)byte_offset;
    (void)n_bytes;
  }
  // What Read of [byte_offset, byte_offset + n_bytes) would read, without reading
  // (ByteSource::DescribeReads). Errors: kUnsupported by default (a provider that does not
  // know, so a tally is never silently short); the provider's own range errors.
  virtual Status DescribeReads(uint64_t byte_offset, uint64_t n_bytes, const SourceRunSink& sink) const;
};

// A tensor placeholder. `provider` may be null only when the tensor has no bytes.
struct SaveTensor {
  DType dtype = DType::kFloat32;
  std::vector<int64_t> shape;  // empty: 0-d tensor (one element)
  std::shared_ptr<const TensorBytesProvider> provider;
  bool requires_grad = false;  // the tensor's requires_grad flag as torch.load restores it
};

// Description of the object to pickle. A value type; containers own their children.
class SaveValue {
 public:
  enum class Kind : uint8_t {
    kNone, kBool, kInt, kFloat, kString, kBytes, kList, kTuple, kDict, kTensor, kGlobal, kObject
  };
  using DictItems = std::vector<std::pair<SaveValue, SaveValue>>;

  SaveValue() = default;  // None

  static SaveValue None() { return SaveValue(); }
  static SaveValue Bool(bool v);
  static SaveValue Int(int64_t v);
  static SaveValue Float(double v);
  static SaveValue Str(std::string v);  // must be valid UTF-8
  // Python bytes. Pickled as protocol 2 does, `_codecs.encode(<latin-1 text>, 'latin1')`,
  // which torch >= 2.x's weights_only unpickler accepts and torch 1.13's refuses.
  static SaveValue Bytes(std::string v);
  static SaveValue List(std::vector<SaveValue> items = {});
  static SaveValue Tuple(std::vector<SaveValue> items = {});
  // Keys must be strings or ints and distinct (checked by Build). `Dict` pickles as a plain
  // dict, `OrderedDict` as collections.OrderedDict; both keep the given item order.
  static SaveValue Dict(DictItems items = {});
  static SaveValue OrderedDict(DictItems items = {});
  static SaveValue Tensor(SaveTensor tensor);
  static SaveValue Tensor(DType dtype, std::vector<int64_t> shape,
                          std::shared_ptr<const TensorBytesProvider> provider);
  // A class or function reference (pickle GLOBAL `module\nname`): neither may hold a newline.
  // Files holding globals other than the writer's own load only with weights_only=False.
  static SaveValue Global(std::string module, std::string name);
  // An instance re-emitted as its pickle built it: `callable` (usually a Global) applied to
  // `args` (a tuple) by REDUCE, or by NEWOBJ when `newobj`; then `list_items` (APPENDS),
  // `dict_items` (SETITEMS, keys of any kind) and, when `state` is given, BUILD with it.
  // Nothing is checked about what the callable does: the reader that loads the file runs it.
  static SaveValue Object(SaveValue callable, SaveValue args, bool newobj,
                          std::optional<SaveValue> state = std::nullopt,
                          std::vector<SaveValue> list_items = {}, DictItems dict_items = {});

  // Builders for containers. Append: list or tuple; Set: dict (appends; no lookup).
  // Calling them on another kind is a programming error (asserts; ignored in release).
  SaveValue& Append(SaveValue item);
  SaveValue& Set(SaveValue key, SaveValue value);
  SaveValue& Set(std::string key, SaveValue value) {
    return Set(Str(std::move(key)), std::move(value));
  }

  // Deep equality: same kinds, values and item order; tensors equal when dtype, shape and
  // provider (the same object) are.
  bool SameAs(const SaveValue& other) const;

  Kind kind() const { return kind_; }
  bool ordered() const { return ordered_; }  // dicts: OrderedDict
  bool bool_value() const { return bool_; }
  int64_t int_value() const { return int_; }
  double float_value() const { return float_; }
  const std::string& string_value() const { return string_; }  // kString, kBytes
  const std::vector<SaveValue>& items() const { return items_; }  // list, tuple
  const DictItems& dict_items() const { return dict_items_; }     // dict
  const SaveTensor& tensor() const { return tensor_; }
  // kGlobal: module in string_value(), name in global_name(). kObject: object_parts() is
  // {callable, args[, state]}, has_state(), newobj(); items() and dict_items() are its
  // APPENDS and SETITEMS.
  const std::string& global_name() const { return name_; }
  const std::vector<SaveValue>& object_parts() const { return parts_; }
  bool has_state() const { return parts_.size() == 3; }
  bool newobj() const { return newobj_; }

 private:
  Kind kind_ = Kind::kNone;
  bool ordered_ = false;
  bool bool_ = false;
  int64_t int_ = 0;
  double float_ = 0;
  std::string string_;
  std::string name_;              // kGlobal
  std::vector<SaveValue> parts_;  // kObject: callable, args[, state]
  bool newobj_ = false;           // kObject
  std::vector<SaveValue> items_;
  DictItems dict_items_;
  SaveTensor tensor_;
};

struct SaveOptions {
  // Archive prefix: one non-empty path component (no '/'), at most 1024 bytes of UTF-8.
  std::string prefix = "archive";
  // Data alignment of every record (torch: 64; GDS users use 4096). A power of two in
  // [1, 32768]; also written as the `.storage_alignment` record.
  uint32_t alignment = 64;
  // false: Build fails with kInvalidArgument on a float, for files that must load with
  // torch 1.13 weights_only=True (see the caveats above).
  bool allow_floats = true;
};

// Where one record lies in the file.
struct RecordLayout {
  std::string name;  // record name without the prefix: "data.pkl", "data/3"
  uint64_t local_header_offset = 0;
  uint64_t data_offset = 0;  // multiple of SaveOptions::alignment
  uint64_t n_bytes = 0;
  uint32_t crc32 = 0;                  // real CRC for in-memory records, 0 for tensor records
  uint16_t local_extra_n_bytes = 0;    // ZIP64 extra (when present) + FB padding field
  uint16_t central_extra_n_bytes = 0;  // ZIP64 extra in the central directory, or 0
  uint8_t descriptor_n_bytes = 0;      // 0 (empty record), 16, or 24 (ZIP64)
  bool zip64 = false;                  // the local header carries a ZIP64 extra
  int64_t tensor_index = -1;           // storage key of a data/<k> record, -1 otherwise
};

class LazyTorchFile final : public ByteSource {
 public:
  // Plans the whole file. `name` is used in error messages (usually the virtual path).
  // Errors: kInvalidArgument (bad prefix or alignment, a float with allow_floats = false, a
  //   negative dimension, a non-string/int or duplicate dict key, invalid UTF-8, a missing
  //   provider for a non-empty tensor, a shape/size/file size that overflows 64 bits),
  //   kUnsupported (quantized dtypes), kResourceExhausted (nesting deeper than 1000).
  static Result<std::shared_ptr<LazyTorchFile>> Build(const SaveValue& root, std::string name,
                                                      const SaveOptions& options = {});

  uint64_t Size() const override { return size_; }
  const std::string& Name() const override { return name_; }
  // Errors: kOutOfRange when the range is not inside [0, Size()); otherwise the first
  // provider error (in byte order) with context. O(log n + bytes); never calls a provider
  // for a range that holds no tensor bytes.
  Status ReadAt(uint64_t byte_offset, std::span<std::byte> out) const override;
  // Passes the hint on to the providers of the tensors in the range.
  void Prefetch(uint64_t byte_offset, uint64_t n_bytes) const override;
  // The runs of the providers of the tensors in the range; header bytes (held in memory) read
  // nothing. Errors: kOutOfRange; a provider's (with the record's name).
  Status DescribeReads(uint64_t byte_offset, uint64_t n_bytes, const SourceRunSink& sink) const override;

  // Read-only layout, for tests and inspection.
  const std::vector<RecordLayout>& records() const { return records_; }
  // The data.pkl bytes.
  std::span<const std::byte> pickle() const {
    return std::span<const std::byte>(memory_).subspan(pickle_memory_offset_, pickle_n_bytes_);
  }
  size_t n_tensors() const { return tensors_.size(); }
  const SaveTensor& tensor(size_t key) const { return tensors_[key]; }
  uint64_t cd_offset() const { return cd_offset_; }
  uint64_t cd_n_bytes() const { return cd_n_bytes_; }
  uint64_t zip64_eocd_offset() const { return zip64_eocd_offset_; }

 private:
  // A contiguous run of the file: header bytes held in memory or one tensor's data.
  struct Segment {
    uint64_t file_offset = 0;
    uint64_t n_bytes = 0;
    uint64_t memory_offset = 0;  // into memory_ (in-memory segments)
    int64_t tensor_index = -1;   // -1: in-memory
  };
  class Emitter;

  LazyTorchFile() = default;

  std::string name_;
  uint64_t size_ = 0;
  size_t pickle_memory_offset_ = 0;  // data.pkl bytes inside memory_
  size_t pickle_n_bytes_ = 0;
  std::vector<SaveTensor> tensors_;
  std::vector<RecordLayout> records_;
  std::vector<Segment> segments_;  // sorted by file_offset, covering [0, size_) exactly
  std::vector<std::byte> memory_;  // all in-memory segment bytes, back to back
  uint64_t cd_offset_ = 0;
  uint64_t cd_n_bytes_ = 0;
  uint64_t zip64_eocd_offset_ = 0;
};

}  // namespace ucpfs::format
