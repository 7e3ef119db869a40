// Binary encoding of the catalog's records (one SourceFile or one Item per LMDB value).
//
// Not for: LMDB access (catalog.cc) or any notion of staleness (that is the fingerprint's job).
// Format: little-endian fixed-width integers; strings and arrays are a u32 count followed by
// their elements. A record is exactly one encoded value: trailing bytes are an error.
//   SourceFile: str rel_path, u64 n_bytes, i64 mtime_ns
//   Item:       u8 kind, str key, then
//     kTensor:  u8 dtype, u32 rank, i64 shape[rank], u32 n_fragments, per fragment:
//               i64 offsets[rank], i64 sizes[rank], u64 flat_lo, u64 flat_hi, u32 file_id,
//               u64 byte_offset, u8 dtype, u32 n_strides (0 or rank), i64 strides[n_strides]
//     kBytes:   u32 file_id, u64 byte_offset, u64 n_bytes
// Decoding trusts nothing: every count is checked against the bytes left before anything is
// allocated, enums against their ranges, and the record must be consumed exactly. Whether a
// file_id indexes the file table is checked by the caller, which knows the table.
// Bump kCatalogSchemaVersion (catalog.h) whenever this format changes.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "core/status.h"
#include "index/checkpoint.h"

namespace ucpfs::index::codec {

std::string EncodeSourceFile(const SourceFile& file);
std::string EncodeItem(const Item& item);

// Errors: kDataLoss with the reason and the byte offset inside the record (e.g. "truncated
// at byte 17 reading fragment 2 of 3").
Result<SourceFile> DecodeSourceFile(std::string_view record);
Result<Item> DecodeItem(std::string_view record);

// Fixed-width helpers shared with catalog.cc (meta values and keys).
std::string EncodeU32Le(uint32_t v);
std::string EncodeU64Le(uint64_t v);
// Big-endian keys so that LMDB's byte order is numeric order.
std::string EncodeU32Be(uint32_t v);
std::string EncodeU64Be(uint64_t v);
// nullopt-like failure when `bytes` is not exactly the width.
bool DecodeU32Le(std::string_view bytes, uint32_t* v);
bool DecodeU64Le(std::string_view bytes, uint64_t* v);
bool DecodeU32Be(std::string_view bytes, uint32_t* v);
bool DecodeU64Be(std::string_view bytes, uint64_t* v);

}  // namespace ucpfs::index::codec
