// The S3 client's pure rules (core/io/s3_config.h): credentials, region, endpoint and addressing
// from environment variables and ~/.aws files with profiles; URLs in both addressings with
// SigV4's canonical query; s3:// names; which failures are retried and the backoff.
#include "core/io/s3_config.h"

#include <curl/curl.h>
#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

namespace ucpfs::s3 {
namespace {

Environment Env(std::map<std::string, std::string> vars, std::optional<std::string> creds = {},
                std::optional<std::string> config = {}) {
  Environment e;
  e.vars = std::move(vars);
  e.credentials_file_text = std::move(creds);
  e.config_file_text = std::move(config);
  e.credentials_file_path = "/home/u/.aws/credentials";
  e.config_file_path = "/home/u/.aws/config";
  return e;
}

TEST(S3Ini, SectionsKeysCommentsAndSubsections) {
  auto ini = ParseIni(
      "# comment\n[default]\naws_access_key_id = AK\n; another\nRegion=eu-west-1 \n\n"
      "[profile train]\ns3 =\n  addressing_style = path\n  endpoint_url = http://h:9000\nregion = r2\n",
      "cfg");
  ASSERT_TRUE(ini.ok()) << ini.error().ToString();
  EXPECT_EQ((*ini)["default"]["aws_access_key_id"], "AK");
  EXPECT_EQ((*ini)["default"]["region"], "eu-west-1");
  EXPECT_EQ((*ini)["profile train"]["s3.addressing_style"], "path");
  EXPECT_EQ((*ini)["profile train"]["s3.endpoint_url"], "http://h:9000");
  EXPECT_EQ((*ini)["profile train"]["region"], "r2");
}

TEST(S3Ini, MalformedLinesNamed) {
  auto a = ParseIni("key = before section\n", "f");
  ASSERT_FALSE(a.ok());
  EXPECT_NE(a.error().message().find("f:1"), std::string::npos);
  auto b = ParseIni("[ok]\njunk line\n", "f");
  ASSERT_FALSE(b.ok());
  EXPECT_NE(b.error().message().find("f:2"), std::string::npos);
  EXPECT_FALSE(ParseIni("[unterminated\n", "f").ok());
}

TEST(S3Options, EnvironmentKeysWinOverFiles) {
  auto o = ResolveOptions(Env({{"AWS_ACCESS_KEY_ID", "EK"}, {"AWS_SECRET_ACCESS_KEY", "ES"}, {"AWS_SESSION_TOKEN", "T"},
                               {"AWS_ENDPOINT_URL", "http://127.0.0.1:7480"}, {"AWS_REGION", "r1"},
                               {"AWS_DEFAULT_REGION", "r0"}},
                              "[default]\naws_access_key_id = FK\naws_secret_access_key = FS\n"));
  ASSERT_TRUE(o.ok()) << o.error().ToString();
  EXPECT_EQ(o->credentials.access_key_id, "EK");
  EXPECT_EQ(o->credentials.secret_access_key, "ES");
  EXPECT_EQ(o->credentials.session_token, "T");
  EXPECT_EQ(o->region, "r1");
  EXPECT_EQ(o->endpoint_url, "http://127.0.0.1:7480");
  // The description names where values came from, never a secret.
  EXPECT_EQ(o->source.find("ES"), std::string::npos);
  EXPECT_NE(o->source.find("AWS_ENDPOINT_URL"), std::string::npos);
}

TEST(S3Options, ProfileFromFiles) {
  std::string creds = "[default]\naws_access_key_id = DK\naws_secret_access_key = DS\n"
                      "[train]\naws_access_key_id = TK\naws_secret_access_key = TS\naws_session_token = TT\n";
  std::string config = "[default]\nregion = us-west-2\n[profile train]\nregion = eu-central-1\n"
                       "s3 =\n  endpoint_url = http://rgw:8080\n  addressing_style = virtual\n";
  auto d = ResolveOptions(Env({}, creds, config));
  ASSERT_TRUE(d.ok()) << d.error().ToString();
  EXPECT_EQ(d->credentials.access_key_id, "DK");
  EXPECT_EQ(d->region, "us-west-2");
  EXPECT_EQ(d->endpoint_url, "https://s3.us-west-2.amazonaws.com");
  EXPECT_EQ(d->addressing, Addressing::kAuto);

  auto t = ResolveOptions(Env({{"AWS_PROFILE", "train"}}, creds, config));
  ASSERT_TRUE(t.ok()) << t.error().ToString();
  EXPECT_EQ(t->credentials.access_key_id, "TK");
  EXPECT_EQ(t->credentials.session_token, "TT");
  EXPECT_EQ(t->region, "eu-central-1");
  EXPECT_EQ(t->endpoint_url, "http://rgw:8080");
  EXPECT_EQ(t->addressing, Addressing::kVirtualHost);

  // AWS_DEFAULT_REGION beats the profile; an override beats everything.
  auto r = ResolveOptions(Env({{"AWS_PROFILE", "train"}, {"AWS_DEFAULT_REGION", "ap-south-1"}}, creds, config),
                          Overrides{"http://other:1", "", Addressing::kPath});
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->region, "ap-south-1");
  EXPECT_EQ(r->endpoint_url, "http://other:1");
  EXPECT_EQ(r->addressing, Addressing::kPath);

  // Keys in the config file when the credentials file has none for the profile.
  auto c = ResolveOptions(Env({{"AWS_PROFILE", "cfg"}}, std::nullopt,
                              "[profile cfg]\naws_access_key_id = CK\naws_secret_access_key = CS\nendpoint_url = http://e:1\n"));
  ASSERT_TRUE(c.ok()) << c.error().ToString();
  EXPECT_EQ(c->credentials.access_key_id, "CK");
  EXPECT_EQ(c->endpoint_url, "http://e:1");

  // The CA bundle: the environment, else the profile.
  auto ca = ResolveOptions(Env({{"AWS_PROFILE", "train"}}, creds, config + "ca_bundle = /etc/profile-ca.pem\n"));
  ASSERT_TRUE(ca.ok());
  EXPECT_EQ(ca->ca_bundle, "/etc/profile-ca.pem");
  auto ca_env = ResolveOptions(Env({{"AWS_PROFILE", "train"}, {"AWS_CA_BUNDLE", "/env-ca.pem"}}, creds,
                                   config + "ca_bundle = /etc/profile-ca.pem\n"));
  EXPECT_EQ(ca_env->ca_bundle, "/env-ca.pem");
}

TEST(S3Options, ErrorsNameTheCause) {
  auto missing = ResolveOptions(Env({{"AWS_PROFILE", "nope"}}, "[default]\n", "[default]\n"));
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.error().message().find("AWS_PROFILE=nope"), std::string::npos);

  auto half = ResolveOptions(Env({{"AWS_ACCESS_KEY_ID", "K"}}));
  ASSERT_FALSE(half.ok());
  EXPECT_NE(half.error().message().find("AWS_SECRET_ACCESS_KEY"), std::string::npos);

  auto half_file = ResolveOptions(Env({}, "[default]\naws_access_key_id = K\n"));
  ASSERT_FALSE(half_file.ok());
  EXPECT_NE(half_file.error().message().find("/home/u/.aws/credentials"), std::string::npos);

  auto bad_ep = ResolveOptions(Env({{"AWS_ENDPOINT_URL", "ftp://x"}}));
  ASSERT_FALSE(bad_ep.ok());
  EXPECT_NE(bad_ep.error().message().find("AWS_ENDPOINT_URL"), std::string::npos);

  EXPECT_FALSE(ResolveOptions(Env({{"AWS_REGION", "us east"}})).ok());
  EXPECT_FALSE(ResolveOptions(Env({}, std::nullopt, "[default]\ns3 =\n  addressing_style = sideways\n")).ok());

  auto anon = ResolveOptions(Env({}));
  ASSERT_TRUE(anon.ok());
  EXPECT_TRUE(anon->credentials.anonymous());
}

TEST(S3Options, LoadsTheFilesTheEnvironmentNames) {
  std::string dir = std::filesystem::temp_directory_path() / ("s3cfg-" + std::to_string(getpid()));
  std::filesystem::create_directories(dir);
  std::ofstream(dir + "/creds") << "[ci]\naws_access_key_id = FILEKEY\naws_secret_access_key = FILESECRET\n";
  std::ofstream(dir + "/config") << "[profile ci]\nregion = eu-north-1\nendpoint_url = http://127.0.0.1:9\n";
  std::map<std::string, std::string> saved;
  for (const char* v : {"AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE", "AWS_PROFILE", "AWS_ACCESS_KEY_ID",
                        "AWS_SECRET_ACCESS_KEY", "AWS_REGION", "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL",
                        "AWS_ENDPOINT_URL_S3"}) {
    if (const char* old = getenv(v)) saved[v] = old;
    unsetenv(v);
  }
  setenv("AWS_SHARED_CREDENTIALS_FILE", (dir + "/creds").c_str(), 1);
  setenv("AWS_CONFIG_FILE", (dir + "/config").c_str(), 1);
  setenv("AWS_PROFILE", "ci", 1);
  auto env = LoadS3Environment();
  ASSERT_TRUE(env.ok()) << env.error().ToString();
  auto o = ResolveOptions(*env);
  ASSERT_TRUE(o.ok()) << o.error().ToString();
  EXPECT_EQ(o->credentials.access_key_id, "FILEKEY");
  EXPECT_EQ(o->region, "eu-north-1");
  EXPECT_EQ(o->endpoint_url, "http://127.0.0.1:9");
  EXPECT_NE(o->source.find(dir + "/creds"), std::string::npos) << o->source;
  // A file over 1 MiB is not read.
  std::ofstream(dir + "/config") << std::string(2 << 20, '#');
  auto big = LoadS3Environment();
  ASSERT_FALSE(big.ok());
  EXPECT_EQ(big.error().code(), StatusCode::kResourceExhausted);
  // Files that do not exist are no error.
  setenv("AWS_CONFIG_FILE", (dir + "/none").c_str(), 1);
  auto none = LoadS3Environment();
  ASSERT_TRUE(none.ok());
  EXPECT_FALSE(none->config_file_text.has_value());
  for (const char* v : {"AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE", "AWS_PROFILE"}) unsetenv(v);
  for (const auto& [k, v] : saved) setenv(k.c_str(), v.c_str(), 1);
  std::filesystem::remove_all(dir);
}

TEST(S3Endpoint, Parse) {
  auto a = ParseEndpoint("http://127.0.0.1:7480");
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->scheme, "http");
  EXPECT_EQ(a->host, "127.0.0.1");
  EXPECT_EQ(a->port, "7480");
  auto b = ParseEndpoint("HTTPS://S3.Example.com/base/");
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->host, "s3.example.com");
  EXPECT_EQ(b->base_path, "/base");
  auto v6 = ParseEndpoint("http://[::1]:9000");
  ASSERT_TRUE(v6.ok());
  EXPECT_EQ(v6->host, "[::1]");
  EXPECT_EQ(v6->port, "9000");
  for (const char* bad : {"127.0.0.1:7480", "http://", "http://h:", "http://h:99999", "http://u:p@h", "http://h/?q",
                          "http://h:8x"}) {
    EXPECT_FALSE(ParseEndpoint(bad).ok()) << bad;
  }
}

TEST(S3Url, PathAndVirtualHostAndCanonicalQuery) {
  Options o;
  o.endpoint_url = "http://127.0.0.1:7480";
  o.addressing = Addressing::kPath;
  auto u = ObjectUrl(o, "bkt", "dir/a b+c~.pt", {{"uploadId", "x/y"}, {"partNumber", "3"}});
  ASSERT_TRUE(u.ok());
  // Sorted by name, every byte but the unreserved ones encoded, '/' kept in the key only.
  EXPECT_EQ(*u, "http://127.0.0.1:7480/bkt/dir/a%20b%2Bc~.pt?partNumber=3&uploadId=x%2Fy");
  auto uploads = ObjectUrl(o, "bkt", "k", {{"uploads", ""}});
  EXPECT_EQ(*uploads, "http://127.0.0.1:7480/bkt/k?uploads=");
  auto bucket_only = ObjectUrl(o, "bkt", "", {{"list-type", "2"}, {"delimiter", "/"}, {"prefix", "ckpt/"}});
  EXPECT_EQ(*bucket_only, "http://127.0.0.1:7480/bkt/?delimiter=%2F&list-type=2&prefix=ckpt%2F");

  o.endpoint_url = "https://localhost:8443/base";
  o.addressing = Addressing::kVirtualHost;
  EXPECT_EQ(*ObjectUrl(o, "bkt", "a/b"), "https://bkt.localhost:8443/base/a/b");
  EXPECT_FALSE(ObjectUrl(o, "Bad_Bucket", "a").ok());
  EXPECT_FALSE(ObjectUrl(o, "", "a").ok());

  // Auto: virtual-host on AWS (not for dotted names over https), path elsewhere.
  o.addressing = Addressing::kAuto;
  o.endpoint_url = "https://s3.us-east-1.amazonaws.com";
  EXPECT_EQ(*ObjectUrl(o, "bkt", "k"), "https://bkt.s3.us-east-1.amazonaws.com/k");
  EXPECT_EQ(*ObjectUrl(o, "my.bkt", "k"), "https://s3.us-east-1.amazonaws.com/my.bkt/k");
  o.endpoint_url = "http://minio:9000";
  EXPECT_EQ(*ObjectUrl(o, "bkt", "k"), "http://minio:9000/bkt/k");
}

TEST(S3Url, BucketNamesAndS3Names) {
  EXPECT_TRUE(IsDnsCompatibleBucket("my-bucket.1"));
  EXPECT_FALSE(IsDnsCompatibleBucket("ab"));
  EXPECT_FALSE(IsDnsCompatibleBucket("-ab"));
  EXPECT_FALSE(IsDnsCompatibleBucket("a..b"));
  EXPECT_FALSE(IsDnsCompatibleBucket("Upper"));
  EXPECT_FALSE(IsDnsCompatibleBucket(std::string(64, 'a')));
  auto a = ParseS3Url("s3://bkt/ckpt/step1/");
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->bucket, "bkt");
  EXPECT_EQ(a->key, "ckpt/step1/");
  EXPECT_EQ(ParseS3Url("s3://bkt")->key, "");
  EXPECT_FALSE(ParseS3Url("s3:///k").ok());
  EXPECT_FALSE(ParseS3Url("/local/path").ok());
  EXPECT_EQ(S3Name("b", "k/x"), "s3://b/k/x");
  EXPECT_EQ(UriEncode("a/b c", false), "a%2Fb%20c");
}

TEST(S3Retry, Classification) {
  EXPECT_TRUE(IsRetryable(CURLE_COULDNT_CONNECT, 0, ""));
  EXPECT_TRUE(IsRetryable(CURLE_OPERATION_TIMEDOUT, 0, ""));
  EXPECT_TRUE(IsRetryable(CURLE_RECV_ERROR, 0, ""));
  EXPECT_TRUE(IsRetryable(CURLE_PARTIAL_FILE, 0, ""));
  EXPECT_FALSE(IsRetryable(CURLE_WRITE_ERROR, 0, ""));  // our own refusal of an oversized body
  EXPECT_FALSE(IsRetryable(CURLE_URL_MALFORMAT, 0, ""));
  EXPECT_FALSE(IsRetryable(CURLE_PEER_FAILED_VERIFICATION, 0, ""));
  for (long s : {500L, 502L, 503L, 504L, 429L}) EXPECT_TRUE(IsRetryable(0, s, "")) << s;
  EXPECT_TRUE(IsRetryable(0, 503, "SlowDown"));
  EXPECT_TRUE(IsRetryable(0, 400, "RequestTimeout"));
  for (long s : {400L, 401L, 403L, 404L, 409L, 412L, 416L}) EXPECT_FALSE(IsRetryable(0, s, "AccessDenied")) << s;
  EXPECT_FALSE(IsRetryable(0, 200, ""));
}

TEST(S3Retry, BackoffIsCappedExponentialWithJitter) {
  RetryPolicy p;
  p.base_delay_ms = 100;
  p.max_delay_ms = 1000;
  EXPECT_EQ(BackoffDelayMs(p, 1, 0.0), 0u);
  EXPECT_EQ(BackoffDelayMs(p, 1, 0.5), 50u);
  EXPECT_EQ(BackoffDelayMs(p, 2, 0.5), 100u);
  EXPECT_EQ(BackoffDelayMs(p, 3, 0.5), 200u);
  EXPECT_EQ(BackoffDelayMs(p, 10, 0.5), 500u);  // capped at max_delay_ms
  EXPECT_LT(BackoffDelayMs(p, 60, 0.9999), 1000u);
  EXPECT_EQ(BackoffDelayMs(p, 1, 7.0), 99u);    // out-of-range randoms clamped
}

}  // namespace
}  // namespace ucpfs::s3
