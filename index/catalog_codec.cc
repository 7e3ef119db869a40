// Catalog record encoding (see catalog_codec.h for the format).
#include "index/catalog_codec.h"

#include <cstring>
#include <utility>

namespace ucpfs::index::codec {
namespace {

class Writer {
 public:
  void U8(uint8_t v) { out_.push_back(static_cast<char>(v)); }
  void U32(uint32_t v) {
    for (int i = 0; i < 4; ++i) out_.push_back(static_cast<char>((v >> (8 * i)) & 0xFF));
  }
  void U64(uint64_t v) {
    for (int i = 0; i < 8; ++i) out_.push_back(static_cast<char>((v >> (8 * i)) & 0xFF));
  }
  void I64(int64_t v) { U64(static_cast<uint64_t>(v)); }
  void Count(size_t n) { U32(static_cast<uint32_t>(n)); }
  void Str(std::string_view s) {
    Count(s.size());
    out_.append(s);
  }
  void I64s(const std::vector<int64_t>& v) {
    for (int64_t x : v) I64(x);
  }
  std::string Take() { return std::move(out_); }

 private:
  std::string out_;
};

// Bounds-checked reader: the first failure is remembered (with its byte offset) and every
// later read fails too, so decoders can check once per logical step.
class Reader {
 public:
  explicit Reader(std::string_view in) : in_(in) {}

  bool ok() const { return error_.empty(); }
  const std::string& error() const { return error_; }
  size_t remaining() const { return in_.size() - pos_; }
  size_t pos() const { return pos_; }

  void Fail(std::string what) {
    if (ok()) error_ = std::move(what);
  }

  bool U8(uint8_t* v, const char* what) {
    if (!Need(1, what)) return false;
    *v = static_cast<uint8_t>(in_[pos_++]);
    return true;
  }
  bool U32(uint32_t* v, const char* what) {
    if (!Need(4, what)) return false;
    uint32_t r = 0;
    for (int i = 0; i < 4; ++i) r |= static_cast<uint32_t>(static_cast<uint8_t>(in_[pos_ + i])) << (8 * i);
    pos_ += 4;
    *v = r;
    return true;
  }
  bool U64(uint64_t* v, const char* what) {
    if (!Need(8, what)) return false;
    uint64_t r = 0;
    for (int i = 0; i < 8; ++i) r |= static_cast<uint64_t>(static_cast<uint8_t>(in_[pos_ + i])) << (8 * i);
    pos_ += 8;
    *v = r;
    return true;
  }
  bool I64(int64_t* v, const char* what) {
    uint64_t u = 0;
    if (!U64(&u, what)) return false;
    *v = static_cast<int64_t>(u);
    return true;
  }
  bool Str(std::string* s, const char* what) {
    uint32_t n = 0;
    if (!U32(&n, what)) return false;
    if (!Need(n, what)) return false;
    s->assign(in_.data() + pos_, n);
    pos_ += n;
    return true;
  }
  // `count` elements of `elem_size` bytes must still be there before anything is allocated.
  bool I64s(uint32_t count, std::vector<int64_t>* v, const char* what) {
    if (!Need(static_cast<uint64_t>(count) * 8, what)) return false;
    v->resize(count);
    for (uint32_t i = 0; i < count; ++i) I64(&(*v)[i], what);
    return ok();
  }
  bool Need(uint64_t n, const char* what) {
    if (!ok()) return false;
    if (n > remaining()) {
      Fail("truncated at byte " + std::to_string(pos_) + " reading " + what + " (" +
           std::to_string(n) + " bytes needed, " + std::to_string(remaining()) + " left)");
      return false;
    }
    return true;
  }

 private:
  std::string_view in_;
  size_t pos_ = 0;
  std::string error_;
};

Status Undecodable(const char* what, const std::string& reason) {
  return Status(StatusCode::kDataLoss, std::string(what) + " record undecodable: " + reason);
}

bool ReadDType(Reader& r, DType* dtype, const char* what) {
  uint8_t raw = 0;
  if (!r.U8(&raw, what)) return false;
  if (raw >= kNumDTypes) {
    r.Fail(std::string("bad dtype ") + std::to_string(raw) + " in " + what);
    return false;
  }
  *dtype = static_cast<DType>(raw);
  return true;
}

// Smallest encoding of one fragment of rank `rank` (no strides).
uint64_t MinFragmentBytes(uint32_t rank) { return static_cast<uint64_t>(rank) * 16 + 8 + 8 + 4 + 8 + 1 + 4 + 4; }

}  // namespace

std::string EncodeSourceFile(const SourceFile& file) {
  Writer w;
  w.Str(file.rel_path);
  w.U64(file.n_bytes);
  w.I64(file.mtime_ns);
  w.U64(file.dev);
  w.U64(file.ino);
  w.I64(file.ctime_ns);
  return w.Take();
}

std::string EncodeItem(const Item& item) {
  Writer w;
  w.U8(static_cast<uint8_t>(item.kind));
  w.Str(item.key);
  if (item.kind == ItemKind::kTensor) {
    const slice::TensorLayout& layout = item.layout;
    w.U8(static_cast<uint8_t>(item.dtype));
    w.U8(item.model_tensor ? 1 : 0);
    w.Count(layout.shape.size());
    w.I64s(layout.shape);
    w.Count(layout.fragments.size());
    for (const slice::Fragment& f : layout.fragments) {
      // The box's rank is the tensor's (ValidateCoverage guarantees it); the decoder checks.
      w.I64s(f.box.offsets);
      w.I64s(f.box.sizes);
      w.U64(f.flat_lo);
      w.U64(f.flat_hi);
      w.U32(f.file_id);
      w.U64(f.byte_offset);
      w.U8(static_cast<uint8_t>(f.dtype));
      w.Count(f.strides.size());
      w.I64s(f.strides);
      w.Count(f.mean_with.size());
      for (const slice::MeanPart& m : f.mean_with) {
        w.U32(m.file_id);
        w.U64(m.byte_offset);
        w.U8(static_cast<uint8_t>(m.dtype));
      }
    }
  } else {
    w.U32(item.file_id);
    w.U64(item.byte_offset);
    w.U64(item.n_bytes);
  }
  return w.Take();
}

Result<SourceFile> DecodeSourceFile(std::string_view record) {
  Reader r(record);
  SourceFile f;
  r.Str(&f.rel_path, "rel_path");
  r.U64(&f.n_bytes, "n_bytes");
  r.I64(&f.mtime_ns, "mtime_ns");
  r.U64(&f.dev, "dev");
  r.U64(&f.ino, "ino");
  r.I64(&f.ctime_ns, "ctime_ns");
  if (r.ok() && r.remaining() != 0) {
    r.Fail(std::to_string(r.remaining()) + " trailing bytes after byte " + std::to_string(r.pos()));
  }
  if (!r.ok()) return Undecodable("file", r.error());
  return f;
}

Result<Item> DecodeItem(std::string_view record) {
  Reader r(record);
  Item item;
  uint8_t kind = 0;
  r.U8(&kind, "kind");
  if (r.ok() && kind > static_cast<uint8_t>(ItemKind::kBytes)) {
    r.Fail("bad item kind " + std::to_string(kind));
  }
  item.kind = static_cast<ItemKind>(kind);
  r.Str(&item.key, "key");
  if (r.ok() && item.kind == ItemKind::kTensor) {
    ReadDType(r, &item.dtype, "tensor dtype");
    uint8_t model_tensor = 0;
    r.U8(&model_tensor, "model_tensor");
    if (r.ok() && model_tensor > 1) r.Fail("bad model_tensor flag " + std::to_string(model_tensor));
    item.model_tensor = model_tensor == 1;
    uint32_t rank = 0;
    r.U32(&rank, "rank");
    r.I64s(rank, &item.layout.shape, "shape");
    uint32_t n_fragments = 0;
    r.U32(&n_fragments, "fragment count");
    if (r.ok() && static_cast<uint64_t>(n_fragments) * MinFragmentBytes(rank) > r.remaining()) {
      r.Fail("fragment count " + std::to_string(n_fragments) + " of rank " + std::to_string(rank) +
             " does not fit in the " + std::to_string(r.remaining()) + " bytes left at byte " +
             std::to_string(r.pos()));
    }
    if (r.ok()) item.layout.fragments.resize(n_fragments);
    for (uint32_t i = 0; r.ok() && i < n_fragments; ++i) {
      slice::Fragment& f = item.layout.fragments[i];
      r.I64s(rank, &f.box.offsets, "fragment offsets");
      r.I64s(rank, &f.box.sizes, "fragment sizes");
      r.U64(&f.flat_lo, "flat_lo");
      r.U64(&f.flat_hi, "flat_hi");
      r.U32(&f.file_id, "fragment file_id");
      r.U64(&f.byte_offset, "fragment byte_offset");
      ReadDType(r, &f.dtype, "fragment dtype");
      uint32_t n_strides = 0;
      r.U32(&n_strides, "stride count");
      if (r.ok() && n_strides != 0 && n_strides != rank) {
        r.Fail("fragment " + std::to_string(i) + " has " + std::to_string(n_strides) +
               " strides for rank " + std::to_string(rank));
      }
      r.I64s(n_strides, &f.strides, "fragment strides");
      uint32_t n_mean = 0;
      r.U32(&n_mean, "mean copy count");
      if (r.ok() && static_cast<uint64_t>(n_mean) * 13 > r.remaining()) {
        r.Fail("fragment " + std::to_string(i) + " has " + std::to_string(n_mean) + " mean copies, more than fit");
      }
      if (r.ok()) f.mean_with.resize(n_mean);
      for (uint32_t k = 0; r.ok() && k < n_mean; ++k) {
        r.U32(&f.mean_with[k].file_id, "mean copy file_id");
        r.U64(&f.mean_with[k].byte_offset, "mean copy byte_offset");
        ReadDType(r, &f.mean_with[k].dtype, "mean copy dtype");
      }
      if (r.ok() && f.flat_lo > f.flat_hi) {
        r.Fail("fragment " + std::to_string(i) + " has flat_lo " + std::to_string(f.flat_lo) +
               " > flat_hi " + std::to_string(f.flat_hi));
      }
    }
  } else if (r.ok()) {
    r.U32(&item.file_id, "file_id");
    r.U64(&item.byte_offset, "byte_offset");
    r.U64(&item.n_bytes, "n_bytes");
  }
  if (r.ok() && r.remaining() != 0) {
    r.Fail(std::to_string(r.remaining()) + " trailing bytes after byte " + std::to_string(r.pos()));
  }
  if (!r.ok()) return Undecodable("item", r.error());
  return item;
}

std::string EncodeU32Le(uint32_t v) {
  Writer w;
  w.U32(v);
  return w.Take();
}

std::string EncodeU64Le(uint64_t v) {
  Writer w;
  w.U64(v);
  return w.Take();
}

std::string EncodeU32Be(uint32_t v) {
  std::string s(4, '\0');
  for (int i = 0; i < 4; ++i) s[i] = static_cast<char>((v >> (8 * (3 - i))) & 0xFF);
  return s;
}

std::string EncodeU64Be(uint64_t v) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>((v >> (8 * (7 - i))) & 0xFF);
  return s;
}

bool DecodeU32Le(std::string_view bytes, uint32_t* v) {
  if (bytes.size() != 4) return false;
  Reader r(bytes);
  return r.U32(v, "u32");
}

bool DecodeU64Le(std::string_view bytes, uint64_t* v) {
  if (bytes.size() != 8) return false;
  Reader r(bytes);
  return r.U64(v, "u64");
}

bool DecodeU32Be(std::string_view bytes, uint32_t* v) {
  if (bytes.size() != 4) return false;
  uint32_t r = 0;
  for (char c : bytes) r = (r << 8) | static_cast<uint8_t>(c);
  *v = r;
  return true;
}

bool DecodeU64Be(std::string_view bytes, uint64_t* v) {
  if (bytes.size() != 8) return false;
  uint64_t r = 0;
  for (char c : bytes) r = (r << 8) | static_cast<uint8_t>(c);
  *v = r;
  return true;
}

}  // namespace ucpfs::index::codec
