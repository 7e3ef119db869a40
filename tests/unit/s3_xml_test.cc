// S3's XML answers (core/io/s3_xml.h), as RGW and AWS send them, and hostile ones: malformed,
// wrong root, huge numbers, DTDs and entity tricks, deep nesting.
#include "core/io/s3_xml.h"

#include <gtest/gtest.h>

namespace ucpfs::s3 {
namespace {

TEST(S3Xml, ListObjectsV2Page) {
  // As RGW 16.2 sent it (ETag quotes as entities), with a delimiter and a next page.
  auto p = ParseListObjectsV2(
      R"(<?xml version="1.0" encoding="UTF-8"?><ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">)"
      R"(<Name>bkt</Name><Prefix>ck/</Prefix><MaxKeys>2</MaxKeys><Delimiter>/</Delimiter><IsTruncated>true</IsTruncated>)"
      R"(<Contents><Key>ck/a &amp; b.pt</Key><LastModified>2026-11-27T10:52:10.171Z</LastModified>)"
      R"(<ETag>&quot;3f1f&quot;</ETag><Size>18446744073709551615</Size><StorageClass>STANDARD</StorageClass></Contents>)"
      R"(<CommonPrefixes><Prefix>ck/rank0/</Prefix></CommonPrefixes><KeyCount>2</KeyCount>)"
      R"(<NextContinuationToken>tok/+=</NextContinuationToken></ListBucketResult>)",
      "list");
  ASSERT_TRUE(p.ok()) << p.error().ToString();
  ASSERT_EQ(p->objects.size(), 1u);
  EXPECT_EQ(p->objects[0].key, "ck/a & b.pt");
  EXPECT_EQ(p->objects[0].etag, "\"3f1f\"");
  EXPECT_EQ(p->objects[0].n_bytes, 18446744073709551615ull);
  EXPECT_EQ(p->objects[0].last_modified, "2026-11-27T10:52:10.171Z");
  ASSERT_EQ(p->common_prefixes.size(), 1u);
  EXPECT_EQ(p->common_prefixes[0], "ck/rank0/");
  EXPECT_TRUE(p->is_truncated);
  EXPECT_EQ(p->next_continuation_token, "tok/+=");

  auto empty = ParseListObjectsV2("<ListBucketResult><IsTruncated>false</IsTruncated></ListBucketResult>", "l");
  ASSERT_TRUE(empty.ok());
  EXPECT_TRUE(empty->objects.empty());
  EXPECT_FALSE(empty->is_truncated);
}

TEST(S3Xml, ListObjectsV2Refusals) {
  const char* bad[] = {
      "<ListBucketResult><Contents><Key>k</Key><Size>18446744073709551616</Size></Contents></ListBucketResult>",
      "<ListBucketResult><Contents><Key>k</Key><Size>-1</Size></Contents></ListBucketResult>",
      "<ListBucketResult><Contents><Size>1</Size></Contents></ListBucketResult>",
      "<ListBucketResult><IsTruncated>true</IsTruncated></ListBucketResult>",
      "<ListBucketResult><IsTruncated>maybe</IsTruncated></ListBucketResult>",
      "<Error><Code>NoSuchBucket</Code></Error>",
      "<ListBucketResult><Contents>",
      "not xml at all",
      "",
  };
  for (const char* b : bad) {
    auto r = ParseListObjectsV2(b, "s3://bkt/: ListObjectsV2");
    ASSERT_FALSE(r.ok()) << b;
    EXPECT_EQ(r.error().code(), StatusCode::kCorrupt) << b;
    EXPECT_NE(r.error().message().find("s3://bkt/"), std::string::npos);
  }
}

TEST(S3Xml, HostileBodies) {
  // Entity expansion and external entities: any DTD is refused.
  auto laughs = ParseErrorBody(
      R"(<?xml version="1.0"?><!DOCTYPE e [<!ENTITY a "aaaaaaaaaa"><!ENTITY b "&a;&a;&a;&a;&a;&a;&a;&a;&a;&a;">]>)"
      R"(<Error><Code>&b;</Code></Error>)",
      "e");
  EXPECT_FALSE(laughs.ok());
  auto external = ParseErrorBody(R"(<!DOCTYPE e [<!ENTITY x SYSTEM "file:///etc/passwd">]><Error><Code>&x;</Code></Error>)", "e");
  EXPECT_FALSE(external.ok());
  std::string deep;
  for (int i = 0; i < 40; ++i) deep += "<a>";
  for (int i = 0; i < 40; ++i) deep += "</a>";
  auto d = ParseErrorBody(deep, "e");
  ASSERT_FALSE(d.ok());
  EXPECT_EQ(d.error().code(), StatusCode::kResourceExhausted);
  EXPECT_FALSE(ParseErrorBody("<Error></Error><Error></Error>", "e").ok());
}

TEST(S3Xml, ErrorBody) {
  auto e = ParseErrorBody(
      R"(<?xml version="1.0" encoding="UTF-8"?><Error><Code>SignatureDoesNotMatch</Code><Message>bad sig</Message>)"
      R"(<RequestId>tx0001</RequestId><HostId>h</HostId></Error>)",
      "e");
  ASSERT_TRUE(e.ok());
  EXPECT_EQ(e->code, "SignatureDoesNotMatch");
  EXPECT_EQ(e->message, "bad sig");
  EXPECT_EQ(e->request_id, "tx0001");
}

TEST(S3Xml, Multipart) {
  auto id = ParseInitiateMultipartUpload(
      R"(<InitiateMultipartUploadResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/"><Bucket>b</Bucket><Key>k</Key>)"
      R"(<UploadId>2~abc</UploadId></InitiateMultipartUploadResult>)",
      "init");
  ASSERT_TRUE(id.ok());
  EXPECT_EQ(*id, "2~abc");
  EXPECT_FALSE(ParseInitiateMultipartUpload("<InitiateMultipartUploadResult/>", "init").ok());

  ErrorBody eb;
  auto done = ParseCompleteMultipartUpload(
      "<CompleteMultipartUploadResult><Location>l</Location><ETag>&quot;e-3&quot;</ETag></CompleteMultipartUploadResult>",
      "c", &eb);
  ASSERT_TRUE(done.ok());
  EXPECT_EQ(*done, "\"e-3\"");
  EXPECT_TRUE(eb.code.empty());
  // A 200 carrying an error.
  auto failed = ParseCompleteMultipartUpload("<Error><Code>InternalError</Code><Message>m</Message></Error>", "c", &eb);
  ASSERT_TRUE(failed.ok());
  EXPECT_EQ(*failed, "");
  EXPECT_EQ(eb.code, "InternalError");

  auto ups = ParseListMultipartUploads(
      "<ListMultipartUploadsResult><IsTruncated>true</IsTruncated><NextKeyMarker>k2</NextKeyMarker>"
      "<NextUploadIdMarker>u2</NextUploadIdMarker><Upload><Key>k1</Key><UploadId>u1</UploadId>"
      "<Initiated>2026-11-27T10:00:00.000Z</Initiated></Upload><Upload><Key>k2</Key><UploadId>u2</UploadId></Upload>"
      "</ListMultipartUploadsResult>",
      "u");
  ASSERT_TRUE(ups.ok()) << ups.error().ToString();
  ASSERT_EQ(ups->uploads.size(), 2u);
  EXPECT_EQ(ups->uploads[0].key, "k1");
  EXPECT_EQ(ups->uploads[0].upload_id, "u1");
  EXPECT_EQ(ups->uploads[0].initiated, "2026-11-27T10:00:00.000Z");
  EXPECT_TRUE(ups->is_truncated);
  EXPECT_EQ(ups->next_key_marker, "k2");
  EXPECT_FALSE(ParseListMultipartUploads("<ListMultipartUploadsResult><Upload><Key>k</Key></Upload></ListMultipartUploadsResult>", "u").ok());

  std::string body = CompleteMultipartUploadBody({{1, "\"a\""}, {2, "\"b&c\""}});
  EXPECT_EQ(body,
            "<CompleteMultipartUpload xmlns=\"http://s3.amazonaws.com/doc/2006-03-01/\"><Part><PartNumber>1</PartNumber>"
            "<ETag>&quot;a&quot;</ETag></Part><Part><PartNumber>2</PartNumber><ETag>&quot;b&amp;c&quot;</ETag></Part>"
            "</CompleteMultipartUpload>");
}

}  // namespace
}  // namespace ucpfs::s3
