// One catalog file, data.mdb, an LMDB environment opened with MDB_NOSUBDIR | MDB_NOLOCK:
//   "meta"  : schema_version (u32 LE), fingerprint (u64 LE), format, flavor, facts (source_facts.h)
//             (strings), n_files, n_items (u64 LE)
//   "files" : u32 BE file_id  -> codec::EncodeSourceFile
//   "items" : u64 BE item index -> codec::EncodeItem
// written whole into a new file and renamed over data.mdb, and read in a forked child so a
// crafted file cannot crash or hang ucpfs. Internal to index/ (catalog.cc uses it).
#pragma once

#include <cstdint>
#include <string>

#include "core/status.h"
#include "index/checkpoint.h"
#include "index/index_dir.h"

namespace ucpfs::index {

// Whether `checkpoint` can be stored and loaded again (file count, facts size, file ids).
Status CheckStorable(const std::string& index_dir, const Checkpoint& checkpoint);

// Builds the catalog in a file of ucpfs's own and renames it over data.mdb: readers see the old
// catalog or the new one, and the old file (maybe a hard link to something else) is never
// written.
Status WriteCatalogFile(const IndexDir& dir, const Checkpoint& checkpoint, uint64_t fingerprint);

// The catalog in dir's data.mdb and its stored fingerprint. Errors: kNotFound (no data.mdb),
// kDataLoss (empty, undecodable, crashed or hung the reader), kInvalidArgument (a symlink or not a
// regular file), kIo.
Result<Checkpoint> ReadCatalogFile(const IndexDir& dir, uint64_t* fingerprint);

}  // namespace ucpfs::index
