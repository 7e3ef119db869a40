// The S3 client's reaction to answers a real store seldom gives on demand (core/io/s3_client.h):
// a loopback HTTP/1.1 server in the test plays a script of canned answers (503 SlowDown, 429,
// 500, 403, a ranged GET answered with the whole object, more bytes than asked, another range,
// an oversized error body) and records each request, so retries, their bounds and the refusals
// are checked exactly. What the client sends is checked too: SigV4 Authorization,
// x-amz-content-sha256, If-Match, the session token. The real store is in tests/s3/.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>

#include "core/io/s3_client.h"

namespace ucpfs::s3 {
namespace {

struct Answer {
  int status = 200;
  std::string headers;  // extra header lines, each ending in \r\n
  std::string body;
};

// Answers each request, on any connection (a thread each), with the next scripted answer (the
// last one repeats), keeping connections alive as S3 does.
class ScriptServer {
 public:
  explicit ScriptServer(std::vector<Answer> script) : script_(std::move(script)) {
    fd_ = socket(AF_INET, SOCK_STREAM, 0);
    int one = 1;
    setsockopt(fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    bind(fd_, reinterpret_cast<sockaddr*>(&a), sizeof a);
    socklen_t len = sizeof a;
    getsockname(fd_, reinterpret_cast<sockaddr*>(&a), &len);
    port_ = ntohs(a.sin_port);
    listen(fd_, 16);
    thread_ = std::thread([this] { Serve(); });
  }
  ~ScriptServer() {
    shutdown(fd_, SHUT_RDWR);
    close(fd_);
    thread_.join();
    {
      std::lock_guard<std::mutex> l(mu_);
      for (int c : conns_) shutdown(c, SHUT_RDWR);
    }
    for (std::thread& t : conn_threads_) t.join();
    for (int c : conns_) close(c);
  }
  std::string endpoint() const { return "http://127.0.0.1:" + std::to_string(port_); }
  std::vector<std::string> requests() {
    std::lock_guard<std::mutex> l(mu_);
    return requests_;
  }

 private:
  void Serve() {
    for (;;) {
      int c = accept(fd_, nullptr, nullptr);
      if (c < 0) return;
      std::lock_guard<std::mutex> l(mu_);
      conns_.push_back(c);
      conn_threads_.emplace_back([this, c] { Talk(c); });
    }
  }
  void Talk(int c) {
    {
      std::string buf;
      char tmp[65536];
      for (;;) {
        size_t end = buf.find("\r\n\r\n");
        if (end == std::string::npos) {
          ssize_t n = recv(c, tmp, sizeof tmp, 0);
          if (n <= 0) break;
          buf.append(tmp, static_cast<size_t>(n));
          continue;
        }
        std::string head = buf.substr(0, end + 4);
        size_t body_len = 0;
        for (const char* name : {"Content-Length: ", "content-length: "}) {
          size_t p = head.find(name);
          if (p != std::string::npos) body_len = std::stoul(head.substr(p + std::strlen(name)));
        }
        if (head.find("Expect: 100-continue") != std::string::npos) {
          std::string cont = "HTTP/1.1 100 Continue\r\n\r\n";
          (void)!send(c, cont.data(), cont.size(), MSG_NOSIGNAL);
        }
        while (buf.size() < end + 4 + body_len) {
          ssize_t n = recv(c, tmp, sizeof tmp, 0);
          if (n <= 0) break;
          buf.append(tmp, static_cast<size_t>(n));
        }
        buf.erase(0, std::min(buf.size(), end + 4 + body_len));
        Answer a;
        {
          std::lock_guard<std::mutex> l(mu_);
          requests_.push_back(head);
          a = script_[std::min(next_, script_.size() - 1)];
          ++next_;
        }
        std::string out = "HTTP/1.1 " + std::to_string(a.status) + " X\r\n" + a.headers +
                          "Content-Length: " + std::to_string(a.body.size()) + "\r\n\r\n";
        if (head.rfind("HEAD ", 0) != 0) out += a.body;
        (void)!send(c, out.data(), out.size(), MSG_NOSIGNAL);
      }
    }
  }
  std::vector<Answer> script_;
  size_t next_ = 0;
  std::mutex mu_;
  std::vector<std::string> requests_;
  std::vector<int> conns_;
  std::vector<std::thread> conn_threads_;
  int fd_ = -1;
  uint16_t port_ = 0;
  std::thread thread_;
};

std::string ErrorXml(const std::string& code) {
  return "<?xml version=\"1.0\"?><Error><Code>" + code + "</Code><Message>m</Message><RequestId>r1</RequestId></Error>";
}

std::shared_ptr<Client> MakeClient(const std::string& endpoint, int max_attempts = 4) {
  Options o;
  o.endpoint_url = endpoint;
  o.addressing = Addressing::kPath;
  o.credentials = {"AKIDTEST", "secret-never-shown", "session-token-1"};
  o.retry.max_attempts = max_attempts;
  o.retry.base_delay_ms = 5;
  auto c = Client::Make(o);
  EXPECT_TRUE(c.ok());
  return *c;
}

TEST(S3ClientScript, RetriesSlowDownAndServerErrorsThenSucceeds) {
  ScriptServer s({{503, "", ErrorXml("SlowDown")},
                  {500, "", ErrorXml("InternalError")},
                  {429, "", ""},
                  {206, "Content-Range: bytes 10-13/100\r\nETag: \"e1\"\r\n", "abcd"}});
  auto c = MakeClient(s.endpoint());
  std::vector<std::byte> out(4);
  Status st = c->GetRange("bkt", "dir/k", 10, out, "\"e1\"");
  ASSERT_TRUE(st.ok()) << st.ToString();
  EXPECT_EQ(std::memcmp(out.data(), "abcd", 4), 0);
  CounterValues cv = c->counters();
  EXPECT_EQ(cv.requests, 4u);
  EXPECT_EQ(cv.retries, 3u);
  EXPECT_EQ(cv.failures, 0u);
  EXPECT_EQ(cv.bytes_get, 4u);
  auto reqs = s.requests();
  ASSERT_EQ(reqs.size(), 4u);
  const std::string& r = reqs[0];
  EXPECT_EQ(r.rfind("GET /bkt/dir/k HTTP/1.1", 0), 0u) << r;
  EXPECT_NE(r.find("Range: bytes=10-13"), std::string::npos) << r;
  EXPECT_NE(r.find("If-Match: \"e1\""), std::string::npos) << r;
  EXPECT_NE(r.find("x-amz-content-sha256: UNSIGNED-PAYLOAD"), std::string::npos) << r;
  EXPECT_NE(r.find("x-amz-security-token: session-token-1"), std::string::npos) << r;
  EXPECT_NE(r.find("Authorization: AWS4-HMAC-SHA256 Credential=AKIDTEST/"), std::string::npos) << r;
  EXPECT_NE(r.find("/us-east-1/s3/aws4_request"), std::string::npos) << r;
  EXPECT_EQ(r.find("secret-never-shown"), std::string::npos);
}

TEST(S3ClientScript, ClientErrorsAreNotRetried) {
  ScriptServer s({{403, "", ErrorXml("AccessDenied")}, {200, "", "never"}});
  auto c = MakeClient(s.endpoint());
  auto info = c->Head("bkt", "k");  // HEAD: no body, the status alone
  ASSERT_FALSE(info.ok());
  EXPECT_EQ(info.error().sys_errno(), EACCES);
  EXPECT_EQ(c->counters().requests, 1u);
  EXPECT_EQ(c->counters().retries, 0u);
  std::vector<std::byte> out(3);
  ScriptServer s404({{404, "", ErrorXml("NoSuchKey")}});
  auto c2 = MakeClient(s404.endpoint());
  Status st = c2->GetRange("bkt", "k", 0, out);
  EXPECT_EQ(st.code(), StatusCode::kNotFound);
  EXPECT_NE(st.message().find("s3://bkt/k: GET bytes 0-2: HTTP 404 NoSuchKey: m (request r1)"), std::string::npos)
      << st.ToString();
  EXPECT_EQ(c2->counters().requests, 1u);
}

TEST(S3ClientScript, RetriesAreBounded) {
  ScriptServer s({{500, "", ErrorXml("InternalError")}});
  auto c = MakeClient(s.endpoint(), 3);
  std::vector<std::byte> out(3);
  Status st = c->GetRange("bkt", "k", 0, out);
  EXPECT_EQ(st.code(), StatusCode::kIo);
  EXPECT_NE(st.message().find("after 3 attempts"), std::string::npos) << st.ToString();
  EXPECT_EQ(c->counters().requests, 3u);
  // The total time bound stops retries before max_attempts.
  Options o = c->options();
  o.retry.max_attempts = 100;
  o.retry.base_delay_ms = 50;
  o.retry.max_total_ms = 120;
  auto timed = Client::Make(o);
  ASSERT_TRUE(timed.ok());
  Status st2 = (*timed)->GetRange("bkt", "k", 0, out);
  EXPECT_FALSE(st2.ok());
  EXPECT_LT((*timed)->counters().requests, 10u);
}

TEST(S3ClientScript, WrongAnswersToRangedGetsAreRefused) {
  std::vector<std::byte> out(4);
  {
    ScriptServer s({{200, "", "0123456789"}});  // Range ignored: the whole object
    auto c = MakeClient(s.endpoint());
    Status st = c->GetRange("bkt", "k", 2, out);
    EXPECT_EQ(st.code(), StatusCode::kCorrupt) << st.ToString();
    EXPECT_NE(st.message().find("Range ignored"), std::string::npos) << st.ToString();
    EXPECT_EQ(c->counters().requests, 1u);
  }
  {
    ScriptServer s({{206, "Content-Range: bytes 2-9/10\r\n", "23456789"}});  // more than asked
    auto c = MakeClient(s.endpoint());
    Status st = c->GetRange("bkt", "k", 2, out);
    EXPECT_EQ(st.code(), StatusCode::kCorrupt) << st.ToString();
    EXPECT_NE(st.message().find("more bytes than"), std::string::npos) << st.ToString();
  }
  {
    ScriptServer s({{206, "Content-Range: bytes 3-6/10\r\n", "3456"}});  // another range
    auto c = MakeClient(s.endpoint());
    Status st = c->GetRange("bkt", "k", 2, out);
    EXPECT_EQ(st.code(), StatusCode::kCorrupt) << st.ToString();
  }
  {
    ScriptServer s({{200, "", "0123"}});  // 200 to a range from 0 covering the object: fine
    auto c = MakeClient(s.endpoint());
    ASSERT_TRUE(c->GetRange("bkt", "k", 0, out).ok());
    EXPECT_EQ(std::memcmp(out.data(), "0123", 4), 0);
  }
  {
    ScriptServer s({{500, "", std::string(64 << 10, 'x')}});  // an error body over the cap
    Options o = MakeClient(s.endpoint())->options();
    o.max_response_bytes = 1024;
    auto c = Client::Make(o);
    Status st = (*c)->GetRange("bkt", "k", 0, out);
    EXPECT_EQ(st.code(), StatusCode::kCorrupt) << st.ToString();
    EXPECT_NE(st.message().find("larger than 1024 bytes"), std::string::npos) << st.ToString();
  }
}

TEST(S3ClientScript, BatchFailsWithTheFirstFailingReadInOrder) {
  // Every read answered with a 412: the first in the order given is reported.
  ScriptServer s({{412, "", ErrorXml("PreconditionFailed")}});
  auto c = MakeClient(s.endpoint());
  std::vector<std::byte> a(2), b(2);
  std::vector<RangeRead> reads{{"bkt", "k1", 0, {}, ""}, {"bkt", "k2", 5, a, "\"x\""}, {"bkt", "k3", 9, b, "\"y\""}};
  size_t failed = 99;
  Status st = c->GetRanges(reads, &failed);
  EXPECT_EQ(st.code(), StatusCode::kDataLoss);
  EXPECT_EQ(failed, 1u);  // the empty read sends nothing
  EXPECT_NE(st.message().find("s3://bkt/k2"), std::string::npos) << st.ToString();
  EXPECT_EQ(c->counters().requests, 2u);
}

TEST(S3ClientScript, TouchingAndNearReadsGoOutAsOneGet) {
  ScriptServer s({{206, "Content-Range: bytes 2-9/20\r\n", "23456789"}});
  auto c = MakeClient(s.endpoint());
  std::vector<std::byte> a(3), b(2), d(3);
  // Given out of order: [5,7), [2,5) touch; [7,10) touches too.
  std::vector<RangeRead> reads{{"bkt", "k", 5, b, ""}, {"bkt", "k", 2, a, ""}, {"bkt", "k", 7, d, ""}};
  ASSERT_TRUE(c->GetRanges(reads).ok());
  EXPECT_EQ(std::memcmp(a.data(), "234", 3), 0);
  EXPECT_EQ(std::memcmp(b.data(), "56", 2), 0);
  EXPECT_EQ(std::memcmp(d.data(), "789", 3), 0);
  auto reqs = s.requests();
  ASSERT_EQ(reqs.size(), 1u);
  EXPECT_NE(reqs[0].find("Range: bytes=2-9"), std::string::npos) << reqs[0];

  // With a gap allowed, the bytes between are fetched and dropped; farther reads stay apart.
  ScriptServer g({{206, "Content-Range: bytes 0-7/20\r\n", "01234567"}});
  Options o = MakeClient(g.endpoint())->options();
  o.merge_gap_bytes = 3;
  auto gc = Client::Make(o);
  std::vector<std::byte> x(2), y(3);
  std::vector<RangeRead> near{{"bkt", "k", 0, x, ""}, {"bkt", "k", 5, y, ""}};
  ASSERT_TRUE((*gc)->GetRanges(near).ok());
  EXPECT_EQ(std::memcmp(x.data(), "01", 2), 0);
  EXPECT_EQ(std::memcmp(y.data(), "567", 3), 0);
  EXPECT_EQ((*gc)->counters().requests, 1u);
  EXPECT_EQ((*gc)->counters().bytes_get, 8u);  // the gap's bytes were fetched
  // Different ETags (versions) or objects never merge.
  ScriptServer v({{206, "Content-Range: bytes 0-1/20\r\n", "01"}, {206, "Content-Range: bytes 2-3/20\r\n", "23"}});
  auto vc = MakeClient(v.endpoint());
  std::vector<RangeRead> versions{{"bkt", "k", 0, x, "\"e1\""}, {"bkt", "k", 2, x, "\"e2\""}};
  (void)vc->GetRanges(versions);
  EXPECT_EQ(vc->counters().requests, 2u);
}

TEST(S3ClientScript, ListPagesFollowTokensAndStopOnARepeatedOne) {
  auto page = [](const std::string& key, const std::string& token) {
    return Answer{200, "",
                  "<ListBucketResult><IsTruncated>" + std::string(token.empty() ? "false" : "true") +
                      "</IsTruncated><NextContinuationToken>" + token + "</NextContinuationToken><Contents><Key>" + key +
                      "</Key><Size>1</Size></Contents></ListBucketResult>"};
  };
  ScriptServer s({page("a", "t1"), page("b", "t2"), page("c", "")});
  auto c = MakeClient(s.endpoint());
  auto all = c->ListObjects("bkt", "p/", "/", 1);
  ASSERT_TRUE(all.ok()) << all.error().ToString();
  ASSERT_EQ(all->objects.size(), 3u);
  auto reqs = s.requests();
  ASSERT_EQ(reqs.size(), 3u);
  EXPECT_EQ(reqs[0].rfind("GET /bkt/?delimiter=%2F&list-type=2&max-keys=1&prefix=p%2F HTTP", 0), 0u) << reqs[0];
  EXPECT_EQ(reqs[1].rfind("GET /bkt/?continuation-token=t1&delimiter=%2F&list-type=2", 0), 0u) << reqs[1];

  ScriptServer loop({page("a", "t1"), page("b", "t1")});
  auto c2 = MakeClient(loop.endpoint());
  auto bad = c2->ListObjects("bkt", "", "", 1);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.error().code(), StatusCode::kCorrupt);
}

}  // namespace
}  // namespace ucpfs::s3
