// The bucket index's manifest (index/bucket_index.h): what is written parses back, and a crafted
// one is refused with the reason, never followed (a path for the object, a bad hash, a stranger).
#include "index/bucket_index.h"

#include <gtest/gtest.h>

namespace ucpfs::index {
namespace {

BucketManifest Sample() {
  BucketManifest m;
  m.schema = kCatalogSchemaVersion;
  m.fingerprint = 0x0123456789abcdefULL;
  m.n_bytes = 24576;
  m.xxh3 = 0xfedcba9876543210ULL;
  m.object = "index-0123456789abcdef-fedcba9876543210.mdb";
  return m;
}

std::string With(const std::string& field, const std::string& json_value) {
  std::string text = BucketManifestText(Sample());
  const size_t at = text.find("\"" + field + "\": ");
  EXPECT_NE(at, std::string::npos) << field;
  const size_t from = at + field.size() + 4, to = text.find_first_of(",\n", from);
  return text.substr(0, from) + json_value + text.substr(to);
}

TEST(BucketManifest, RoundTrips) {
  auto m = ParseBucketManifest(BucketManifestText(Sample()), "s3://b/p/.ucpfs/index.json");
  ASSERT_TRUE(m.ok()) << m.error().ToString();
  EXPECT_EQ(m->schema, kCatalogSchemaVersion);
  EXPECT_EQ(m->fingerprint, Sample().fingerprint);
  EXPECT_EQ(m->xxh3, Sample().xxh3);
  EXPECT_EQ(m->n_bytes, 24576u);
  EXPECT_EQ(m->object, Sample().object);
}

TEST(BucketManifest, CraftedOnesAreRefusedNamingTheManifest) {
  const std::string where = "s3://b/p/.ucpfs/index.json";
  for (const std::string& text : {
           std::string("not json"), std::string("[1]"), std::string("{}"),
           With("format", "\"other\""), With("version", "2"), With("schema", "-1"),
           With("schema", "4294967296"), With("n_bytes", "\"big\""), With("n_bytes", "-5"),
           With("object", "\"../../etc/passwd\""), With("object", "\"index-0123456789abcdef-fedcba9876543210.mdb/x\""),
           With("object", "\"index-0123456789ABCDEF-fedcba9876543210.mdb\""), With("object", "7"),
           With("fingerprint", "\"0123\""), With("xxh3", "\"zzzzzzzzzzzzzzzz\""), With("xxh3", "12")}) {
    auto m = ParseBucketManifest(text, where);
    ASSERT_FALSE(m.ok()) << text;
    EXPECT_EQ(m.error().code(), StatusCode::kCorrupt) << text;
    EXPECT_NE(m.error().message().find(where), std::string::npos) << m.error().ToString();
  }
}

}  // namespace
}  // namespace ucpfs::index
