// See s3_client.h. Every call builds Requests and runs them through Execute: a multi handle of its
// own (so calls on different threads never wait for each other's transfers) whose easy handles
// share the client's connection cache through one CURLSH, so connections are reused across calls
// and threads. An easy handle is made per attempt: a retry starts from a clean state (buffer
// position, headers, body read position).
#include "core/io/s3_client.h"

#include "core/io/curl_api.h"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <deque>
#include <mutex>
#include <random>
#include <thread>
#include <tuple>
#include <unordered_map>

namespace ucpfs::s3 {
namespace {

using Clock = std::chrono::steady_clock;

constexpr size_t kMaxHeaderValueBytes = 1024;  // ETag, dates, Content-Range: short by nature
constexpr uint64_t kLargeGetBytes = uint64_t{256} << 10;  // receive buffer of a ranged GET at least this large

enum class Kind {
  kGetRange,  // body into the caller's buffer
  kHead,
  kText,      // body (if any) into Request::text, capped
};

struct Request {
  Kind kind = Kind::kText;
  std::string method;  // GET HEAD PUT POST DELETE
  std::string url;
  std::string object;  // "s3://bucket/key": what per-object counters name
  std::string what;    // "s3://b/k: GET bytes 0-99"
  std::vector<std::string> headers;
  std::span<const std::byte> body;  // PUT/POST body
  // kGetRange: the range asked is [range_offset, range_offset + range_n_bytes); its bytes go to
  // the targets (sorted, disjoint, at offsets relative to range_offset), bytes between them are
  // dropped (nearby reads merged into one GET).
  struct Target {
    uint64_t rel_offset = 0;
    std::span<std::byte> out;
  };
  std::vector<Target> targets;
  uint64_t range_offset = 0;
  uint64_t range_n_bytes = 0;
  size_t next_target = 0;  // the first target not filled yet (write order is byte order)

  // Filled by each attempt (reset at its start).
  long http_status = 0;
  std::string etag, last_modified, content_range, request_id;
  int64_t content_length = -1;
  uint64_t out_written = 0;
  std::string text;
  std::string refused;  // why the write callback stopped the transfer (not retried)
  uint64_t body_sent = 0;

  // The outcome.
  int attempts = 0;
  Status status;

  void ResetAttempt() {
    http_status = 0;
    etag.clear();
    last_modified.clear();
    content_range.clear();
    request_id.clear();
    content_length = -1;
    out_written = 0;
    next_target = 0;
    text.clear();
    refused.clear();
    body_sent = 0;
  }
};

std::string Lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

double UnitRandom() {
  thread_local std::mt19937_64 rng{std::random_device{}()};
  return std::uniform_real_distribution<double>(0.0, 1.0)(rng);
}

}  // namespace

struct Client::Impl {
  const Options* options = nullptr;
  const CurlApi* curl = nullptr;  // loaded by Make (curl_api.h): every libcurl call goes through it
  CURLSH* share = nullptr;
  std::mutex locks[CURL_LOCK_DATA_LAST];
  std::atomic<uint64_t> requests{0}, retries{0}, failures{0}, bytes_get{0}, bytes_put{0}, connects{0};
  std::atomic<uint64_t> writes{0};  // Client::writes()
  // A request that changes objects, counted in writes when it begins and when it ends.
  Status ExecuteWrite(Request& r) {
    writes += 1;
    Status st = ExecuteOne(r);
    writes += 1;
    return st;
  }
  // Ranged GET body bytes per object (Client::ObjectBytesGet), at most kMaxCountedObjects names.
  mutable std::mutex objects_mu;
  std::unordered_map<std::string, uint64_t> object_bytes_get;
  uint64_t uncounted_bytes_get = 0;

  void CountObjectBytes(const std::string& object, uint64_t n_bytes) {
    if (n_bytes == 0) return;
    std::lock_guard<std::mutex> lock(objects_mu);
    auto it = object_bytes_get.find(object);
    if (it != object_bytes_get.end()) {
      it->second += n_bytes;
    } else if (object_bytes_get.size() < kMaxCountedObjects) {
      object_bytes_get.emplace(object, n_bytes);
    } else {
      uncounted_bytes_get += n_bytes;
    }
  }

  struct Transfer {
    Request* req = nullptr;
    Impl* impl = nullptr;
    CURL* easy = nullptr;
    curl_slist* header_list = nullptr;
    Clock::time_point first_start{};
    Clock::time_point not_before{};
    bool started = false;
  };

  static void Lock(CURL*, curl_lock_data data, curl_lock_access, void* user) {
    static_cast<Impl*>(user)->locks[data].lock();
  }
  static void Unlock(CURL*, curl_lock_data data, void* user) { static_cast<Impl*>(user)->locks[data].unlock(); }

  static size_t OnHeader(char* buf, size_t size, size_t n, void* user) {
    auto* t = static_cast<Transfer*>(user);
    Request& r = *t->req;
    size_t len = size * n;
    std::string line(buf, len);
    while (!line.empty() && (line.back() == '\n' || line.back() == '\r')) line.pop_back();
    if (line.rfind("HTTP/", 0) == 0) {  // a new response (after a 100 Continue): forget the last
      r.etag.clear();
      r.last_modified.clear();
      r.content_range.clear();
      r.request_id.clear();
      return len;
    }
    size_t colon = line.find(':');
    if (colon == std::string::npos) return len;
    std::string name = Lower(line.substr(0, colon));
    size_t v = line.find_first_not_of(" \t", colon + 1);
    std::string value = v == std::string::npos ? "" : line.substr(v);
    if (value.size() > kMaxHeaderValueBytes) value.resize(kMaxHeaderValueBytes);
    if (name == "etag") r.etag = value;
    else if (name == "last-modified") r.last_modified = value;
    else if (name == "content-range") r.content_range = value;
    else if (name == "x-amz-request-id") r.request_id = value;
    return len;
  }

  static size_t OnWrite(char* buf, size_t size, size_t n, void* user) {
    auto* t = static_cast<Transfer*>(user);
    Request& r = *t->req;
    size_t len = size * n;
    long code = 0;
    t->impl->curl->easy_getinfo(t->easy, CURLINFO_RESPONSE_CODE, &code);
    if (r.kind == Kind::kGetRange && code / 100 == 2) {
      // A 200 is the whole object: only the bytes from 0 are what was asked.
      if (code != 206 && r.range_offset != 0) {
        r.refused = "the server answered " + std::to_string(code) + " to a ranged GET (Range ignored)";
        return 0;
      }
      if (len > r.range_n_bytes - r.out_written) {
        r.refused = "the server sent more bytes than the " + std::to_string(r.range_n_bytes) + " asked";
        return 0;
      }
      // [pos, end) of the range arrives now: copy what falls into targets, skip the gaps.
      const uint64_t pos = r.out_written, end = pos + len;
      for (size_t k = r.next_target; k < r.targets.size(); ++k) {
        const Request::Target& tg = r.targets[k];
        const uint64_t tg_end = tg.rel_offset + tg.out.size();
        if (tg.rel_offset >= end) break;
        const uint64_t from = std::max(pos, tg.rel_offset), to = std::min(end, tg_end);
        if (from < to) std::memcpy(tg.out.data() + (from - tg.rel_offset), buf + (from - pos), to - from);
        if (tg_end <= end) r.next_target = k + 1;
      }
      r.out_written = end;
      t->impl->bytes_get += len;
      return len;
    }
    if (r.text.size() + len > t->impl->options->max_response_bytes) {
      r.refused = "the answer is larger than " + std::to_string(t->impl->options->max_response_bytes) + " bytes";
      return 0;
    }
    r.text.append(buf, len);
    if (r.method == "GET" && code / 100 == 2) t->impl->bytes_get += len;
    return len;
  }

  static size_t OnRead(char* buf, size_t size, size_t n, void* user) {
    auto* t = static_cast<Transfer*>(user);
    Request& r = *t->req;
    size_t len = std::min(size * n, r.body.size() - r.body_sent);
    std::memcpy(buf, r.body.data() + r.body_sent, len);
    r.body_sent += len;
    return len;
  }

  Status StartAttempt(Transfer& t, CURLM* multi) {
    Request& r = *t.req;
    r.ResetAttempt();
    // The retry budget (RetryPolicy::max_total_ms) runs from a transfer's own first attempt, not
    // from the batch's start: a late starter in a large batch gets the same time as the first.
    if (r.attempts == 0) t.first_start = Clock::now();
    ++r.attempts;
    ++requests;
    CURL* e = curl->easy_init();
    if (!e) return InternalError(r.what + ": curl_easy_init failed");
    t.easy = e;
    curl->easy_setopt(e, CURLOPT_SHARE, share);
    curl->easy_setopt(e, CURLOPT_URL, r.url.c_str());
    curl->easy_setopt(e, CURLOPT_NOSIGNAL, 1L);
    curl->easy_setopt(e, CURLOPT_PATH_AS_IS, 1L);  // keys are paths S3 sees as they are ("a/../b")
    curl->easy_setopt(e, CURLOPT_TCP_KEEPALIVE, 1L);
    curl->easy_setopt(e, CURLOPT_CONNECTTIMEOUT_MS, static_cast<long>(options->connect_timeout_ms));
    curl->easy_setopt(e, CURLOPT_LOW_SPEED_LIMIT, 1024L);
    curl->easy_setopt(e, CURLOPT_LOW_SPEED_TIME, static_cast<long>(std::max<uint64_t>(1, options->low_speed_time_ms / 1000)));
    curl->easy_setopt(e, CURLOPT_PROTOCOLS_STR, "http,https");
    if (!options->ca_bundle.empty()) curl->easy_setopt(e, CURLOPT_CAINFO, options->ca_bundle.c_str());
    curl->easy_setopt(e, CURLOPT_HEADERFUNCTION, &Impl::OnHeader);
    curl->easy_setopt(e, CURLOPT_HEADERDATA, &t);
    curl->easy_setopt(e, CURLOPT_WRITEFUNCTION, &Impl::OnWrite);
    curl->easy_setopt(e, CURLOPT_WRITEDATA, &t);
    curl->easy_setopt(e, CURLOPT_PRIVATE, &t);
    const Credentials& c = options->credentials;
    std::string sigv4;
    if (!c.anonymous()) {
      sigv4 = "aws:amz:" + options->region + ":s3";
      curl->easy_setopt(e, CURLOPT_AWS_SIGV4, sigv4.c_str());  // copied by libcurl
      curl->easy_setopt(e, CURLOPT_USERNAME, c.access_key_id.c_str());
      curl->easy_setopt(e, CURLOPT_PASSWORD, c.secret_access_key.c_str());
    }
    curl_slist* h = nullptr;
    // S3 needs the payload's hash header; its value is what libcurl signs as the payload.
    h = curl->slist_append(h, "x-amz-content-sha256: UNSIGNED-PAYLOAD");
    if (!c.session_token.empty()) h = curl->slist_append(h, ("x-amz-security-token: " + c.session_token).c_str());
    for (const std::string& x : r.headers) h = curl->slist_append(h, x.c_str());
    t.header_list = h;
    curl->easy_setopt(e, CURLOPT_HTTPHEADER, h);
    if (r.method == "HEAD") {
      curl->easy_setopt(e, CURLOPT_NOBODY, 1L);
    } else if (r.method == "PUT") {
      curl->easy_setopt(e, CURLOPT_UPLOAD, 1L);
      curl->easy_setopt(e, CURLOPT_READFUNCTION, &Impl::OnRead);
      curl->easy_setopt(e, CURLOPT_READDATA, &t);
      curl->easy_setopt(e, CURLOPT_INFILESIZE_LARGE, static_cast<curl_off_t>(r.body.size()));
    } else if (r.method == "POST") {
      curl->easy_setopt(e, CURLOPT_POST, 1L);
      curl->easy_setopt(e, CURLOPT_POSTFIELDS, reinterpret_cast<const char*>(r.body.data()));
      curl->easy_setopt(e, CURLOPT_POSTFIELDSIZE_LARGE, static_cast<curl_off_t>(r.body.size()));
    } else if (r.method == "DELETE") {
      curl->easy_setopt(e, CURLOPT_CUSTOMREQUEST, "DELETE");
    }
    if (r.kind == Kind::kGetRange) {
      std::string range = std::to_string(r.range_offset) + "-" + std::to_string(r.range_offset + r.range_n_bytes - 1);
      curl->easy_setopt(e, CURLOPT_RANGE, range.c_str());  // copied by libcurl
      // A large body is received in large pieces: one recv and one write callback per 256 KiB
      // instead of per 16 KiB (curl's default buffer).
      if (r.range_n_bytes >= kLargeGetBytes) curl->easy_setopt(e, CURLOPT_BUFFERSIZE, static_cast<long>(kLargeGetBytes));
    }
    CURLMcode mc = curl->multi_add_handle(multi, e);
    if (mc != CURLM_OK) return InternalError(r.what + ": curl_multi_add_handle: " + curl->multi_strerror(mc));
    t.started = true;
    return Status::Ok();
  }

  void EndAttempt(Transfer& t, CURLM* multi) {
    if (t.easy) {
      curl->multi_remove_handle(multi, t.easy);
      curl->easy_cleanup(t.easy);
      t.easy = nullptr;
    }
    curl->slist_free_all(t.header_list);
    t.header_list = nullptr;
    t.started = false;
  }

  // The outcome of a finished attempt: Ok, or an error and whether to try again.
  Status Judge(Request& r, CURLcode cc, bool* retry) {
    *retry = false;
    const std::string tries = r.attempts > 1 ? " (after " + std::to_string(r.attempts) + " attempts)" : "";
    if (!r.refused.empty()) return CorruptError(r.what + ": " + r.refused);
    if (cc != CURLE_OK) {
      *retry = IsRetryable(static_cast<int>(cc), 0, "");
      int err = cc == CURLE_OPERATION_TIMEDOUT ? ETIMEDOUT : cc == CURLE_COULDNT_CONNECT ? ECONNREFUSED : EIO;
      return IoError(r.what + ": " + curl->easy_strerror(cc) + tries, err);
    }
    long code = r.http_status;
    if (code / 100 == 2) {
      if (r.kind == Kind::kGetRange) {
        if (r.out_written != r.range_n_bytes) {
          *retry = true;  // the connection ended early without an error: try again
          return IoError(r.what + ": the server sent " + std::to_string(r.out_written) + " of " +
                             std::to_string(r.range_n_bytes) + " bytes" + tries, EIO);
        }
        if (code == 206) {
          // "bytes START-END/TOTAL": the range asked, not another one.
          std::string want = "bytes " + std::to_string(r.range_offset) + "-" +
                             std::to_string(r.range_offset + r.range_n_bytes - 1) + "/";
          if (r.content_range.rfind(want, 0) != 0) {
            return CorruptError(r.what + ": the server sent the range '" + r.content_range + "'");
          }
        }
      }
      return Status::Ok();
    }
    ErrorBody eb;
    if (!r.text.empty()) {
      if (auto parsed = ParseErrorBody(r.text, r.what); parsed.ok()) eb = std::move(parsed).value();
    }
    *retry = IsRetryable(0, code, eb.code);
    std::string msg = r.what + ": HTTP " + std::to_string(code);
    if (!eb.code.empty()) msg += " " + eb.code;
    if (!eb.message.empty()) msg += ": " + eb.message;
    std::string rid = !eb.request_id.empty() ? eb.request_id : r.request_id;
    if (!rid.empty()) msg += " (request " + rid + ")";
    msg += tries;
    if (code == 404) return NotFoundError(msg);
    if (code == 401 || code == 403) return Status(StatusCode::kIo, msg, EACCES);
    if (code == 412) return Status(StatusCode::kDataLoss, msg);
    if (code == 416) return OutOfRangeError(msg);
    if (code >= 400 && code < 500 && !*retry) return InvalidArgumentError(msg);
    return IoError(msg, EIO);
  }

  // Runs every request to its end (success, or failure after its retries); each one's Status.
  void Execute(std::span<Request> reqs) {
    CURLM* multi = curl->multi_init();
    if (!multi) {
      for (Request& r : reqs) r.status = InternalError(r.what + ": curl_multi_init failed");
      return;
    }
    // libcurl keeps at most this many connections open when a transfer ends; its default (4 per
    // handle still in the multi) would close most of them as a batch drains.
    curl->multi_setopt(multi, CURLMOPT_MAXCONNECTS, static_cast<long>(std::max(1, options->max_idle_connections)));
    std::vector<Transfer> ts(reqs.size());
    std::deque<size_t> ready;
    std::vector<size_t> waiting;  // retries not due yet
    for (size_t i = 0; i < reqs.size(); ++i) {
      ts[i].req = &reqs[i];
      ts[i].impl = this;
      ready.push_back(i);
    }
    size_t in_flight = 0, done = 0;
    const size_t max_in_flight = static_cast<size_t>(std::max(1, options->max_in_flight));
    while (done < reqs.size()) {
      Clock::time_point now = Clock::now();
      for (auto it = waiting.begin(); it != waiting.end();) {
        if (ts[*it].not_before <= now) {
          ready.push_back(*it);
          it = waiting.erase(it);
        } else {
          ++it;
        }
      }
      while (in_flight < max_in_flight && !ready.empty()) {
        size_t i = ready.front();
        ready.pop_front();
        Status st = StartAttempt(ts[i], multi);
        if (!st.ok()) {
          EndAttempt(ts[i], multi);
          reqs[i].status = st;
          ++failures;
          ++done;
          continue;
        }
        ++in_flight;
      }
      int running = 0;
      curl->multi_perform(multi, &running);
      int left = 0;
      while (CURLMsg* m = curl->multi_info_read(multi, &left)) {
        if (m->msg != CURLMSG_DONE) continue;
        Transfer* t = nullptr;
        curl->easy_getinfo(m->easy_handle, CURLINFO_PRIVATE, reinterpret_cast<char**>(&t));
        CURLcode cc = m->data.result;
        Request& r = *t->req;
        curl->easy_getinfo(t->easy, CURLINFO_RESPONSE_CODE, &r.http_status);
        curl_off_t cl = -1;
        curl->easy_getinfo(t->easy, CURLINFO_CONTENT_LENGTH_DOWNLOAD_T, &cl);
        r.content_length = cl;
        long n_connects = 0;
        curl->easy_getinfo(t->easy, CURLINFO_NUM_CONNECTS, &n_connects);
        connects += static_cast<uint64_t>(std::max(0L, n_connects));
        if (r.method == "PUT") bytes_put += r.body_sent;
        if (r.kind == Kind::kGetRange) CountObjectBytes(r.object, r.out_written);
        EndAttempt(*t, multi);
        --in_flight;
        bool retry = false;
        Status st = Judge(r, cc, &retry);
        if (!st.ok() && retry && r.attempts < options->retry.max_attempts) {
          uint64_t delay_ms = BackoffDelayMs(options->retry, r.attempts, UnitRandom());
          Clock::time_point due = Clock::now() + std::chrono::milliseconds(delay_ms);
          if (due - t->first_start <= std::chrono::milliseconds(options->retry.max_total_ms)) {
            ++retries;
            t->not_before = due;
            waiting.push_back(static_cast<size_t>(t - ts.data()));
            continue;
          }
        }
        r.status = st;
        if (!st.ok()) ++failures;
        ++done;
      }
      if (done == reqs.size()) break;
      // Sleep until a socket is ready or the next retry is due (at most 100 ms).
      int timeout_ms = 100;
      if (in_flight == 0 && ready.empty() && !waiting.empty()) {
        Clock::time_point next = ts[waiting.front()].not_before;
        for (size_t w : waiting) next = std::min(next, ts[w].not_before);
        auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(next - Clock::now()).count();
        timeout_ms = static_cast<int>(std::clamp<int64_t>(ms, 0, 100));
      }
      curl->multi_poll(multi, nullptr, 0, timeout_ms, nullptr);
    }
    for (Transfer& t : ts) EndAttempt(t, multi);
    curl->multi_cleanup(multi);
  }

  Status ExecuteOne(Request& r) {
    Execute(std::span<Request>(&r, 1));
    return r.status;
  }
};

Client::Client(Options options) : options_(std::move(options)), impl_(std::make_unique<Impl>()) {}

Client::~Client() {
  if (impl_ && impl_->share) impl_->curl->share_cleanup(impl_->share);
}

Result<std::shared_ptr<Client>> Client::Make(Options options) {
  UCPFS_RETURN_IF_ERROR(ParseEndpoint(options.endpoint_url).status());
  UCPFS_ASSIGN_OR_RETURN(const CurlApi* curl, LoadCurl());
  std::shared_ptr<Client> c(new Client(std::move(options)));
  Impl& im = *c->impl_;
  im.options = &c->options_;
  im.curl = curl;
  im.share = curl->share_init();
  if (!im.share) return InternalError("curl_share_init failed");
  curl->share_setopt(im.share, CURLSHOPT_LOCKFUNC, &Impl::Lock);
  curl->share_setopt(im.share, CURLSHOPT_UNLOCKFUNC, &Impl::Unlock);
  curl->share_setopt(im.share, CURLSHOPT_USERDATA, &im);
  curl->share_setopt(im.share, CURLSHOPT_SHARE, CURL_LOCK_DATA_CONNECT);
  curl->share_setopt(im.share, CURLSHOPT_SHARE, CURL_LOCK_DATA_DNS);
  curl->share_setopt(im.share, CURLSHOPT_SHARE, CURL_LOCK_DATA_SSL_SESSION);
  return c;
}

uint64_t Client::writes() const { return impl_->writes.load(); }

CounterValues Client::counters() const {
  return CounterValues{impl_->requests.load(), impl_->retries.load(), impl_->failures.load(), impl_->bytes_get.load(),
                       impl_->bytes_put.load(), impl_->connects.load()};
}

ObjectBytes Client::ObjectBytesGet() const {
  ObjectBytes out;
  std::lock_guard<std::mutex> lock(impl_->objects_mu);
  out.by_object.assign(impl_->object_bytes_get.begin(), impl_->object_bytes_get.end());
  std::sort(out.by_object.begin(), out.by_object.end());
  out.uncounted = impl_->uncounted_bytes_get;
  return out;
}

namespace {

Result<Request> MakeRequest(const Options& o, Kind kind, const char* method, const std::string& bucket,
                            const std::string& key, std::map<std::string, std::string> query, const std::string& op) {
  Request r;
  r.kind = kind;
  r.method = method;
  r.object = key.empty() ? "s3://" + bucket : S3Name(bucket, key);
  r.what = r.object + ": " + op;
  auto url = ObjectUrl(o, bucket, key, std::move(query));
  if (!url.ok()) return url.error().WithContext(r.what);
  r.url = std::move(url).value();
  return r;
}

}  // namespace

Result<ObjectInfo> Client::Head(const std::string& bucket, const std::string& key) {
  UCPFS_ASSIGN_OR_RETURN(Request r, MakeRequest(options_, Kind::kHead, "HEAD", bucket, key, {}, "HEAD"));
  UCPFS_RETURN_IF_ERROR(impl_->ExecuteOne(r));
  if (r.content_length < 0) return CorruptError(r.what + ": the answer has no Content-Length");
  return ObjectInfo{static_cast<uint64_t>(r.content_length), r.etag, r.last_modified};
}

Status Client::GetRange(const std::string& bucket, const std::string& key, uint64_t byte_offset,
                        std::span<std::byte> out, const std::string& if_match) {
  RangeRead one{bucket, key, byte_offset, out, if_match};
  return GetRanges(std::span<const RangeRead>(&one, 1));
}

Status Client::GetRanges(std::span<const RangeRead> reads, size_t* failed_index) {
  // The reads of one object and version, by offset: neighbours at most merge_gap_bytes apart are
  // merged into one GET (up to max_get_bytes, the gap's bytes dropped); a read larger than
  // max_get_bytes and pinned to an ETag goes out as several GETs in flight together (one stream
  // is often slower than the link; without an ETag it stays one GET, so its bytes come from one
  // version of the object).
  std::vector<size_t> order;
  order.reserve(reads.size());
  for (size_t i = 0; i < reads.size(); ++i) {
    const RangeRead& rr = reads[i];
    if (rr.out.empty()) continue;
    if (rr.byte_offset > UINT64_MAX - rr.out.size()) {
      if (failed_index) *failed_index = i;
      return OutOfRangeError(S3Name(rr.bucket, rr.key) + ": range past 2^64");
    }
    order.push_back(i);
  }
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    const RangeRead &x = reads[a], &y = reads[b];
    return std::tie(x.bucket, x.key, x.if_match, x.byte_offset) < std::tie(y.bucket, y.key, y.if_match, y.byte_offset);
  });
  const uint64_t max_get = options_.max_get_bytes == 0 ? UINT64_MAX : options_.max_get_bytes;
  std::vector<Request> reqs;
  std::vector<size_t> first_read;  // reqs[j] serves reads[first_read[j]] (the lowest index it serves)
  for (size_t o = 0; o < order.size();) {
    const RangeRead& head = reads[order[o]];
    // Reads o..e-1 are merged: same object and version, disjoint and close, within max_get_bytes.
    size_t e = o + 1;
    uint64_t end = head.byte_offset + head.out.size();
    while (e < order.size()) {
      const RangeRead& nx = reads[order[e]];
      if (nx.bucket != head.bucket || nx.key != head.key || nx.if_match != head.if_match) break;
      if (nx.byte_offset < end || nx.byte_offset - end > options_.merge_gap_bytes) break;
      if (nx.byte_offset + nx.out.size() - head.byte_offset > max_get) break;
      end = nx.byte_offset + nx.out.size();
      ++e;
    }
    const uint64_t total = end - head.byte_offset;
    // One read alone may be split (pinned to an ETag); merged reads never exceed max_get_bytes.
    const uint64_t chunk = (e == o + 1 && !head.if_match.empty()) ? std::min(max_get, total) : total;
    for (uint64_t done = 0; done < total; done += chunk) {
      const uint64_t n = std::min<uint64_t>(chunk, total - done);
      const uint64_t off = head.byte_offset + done;
      auto made = MakeRequest(options_, Kind::kGetRange, "GET", head.bucket, head.key, {},
                              "GET bytes " + std::to_string(off) + "-" + std::to_string(off + n - 1));
      if (!made.ok()) {
        if (failed_index) *failed_index = order[o];
        return made.error();
      }
      Request r = std::move(made).value();
      r.range_offset = off;
      r.range_n_bytes = n;
      size_t lowest = order[o];
      for (size_t k = o; k < e; ++k) {
        const RangeRead& rr = reads[order[k]];
        // The part of this read inside [off, off + n).
        const uint64_t from = std::max(rr.byte_offset, off), to = std::min(rr.byte_offset + rr.out.size(), off + n);
        if (from >= to) continue;
        r.targets.push_back({from - off, rr.out.subspan(from - rr.byte_offset, to - from)});
        lowest = std::min(lowest, order[k]);
      }
      if (!head.if_match.empty()) r.headers.push_back("If-Match: " + head.if_match);
      reqs.push_back(std::move(r));
      first_read.push_back(lowest);
    }
    o = e;
  }
  impl_->Execute(reqs);
  // The first failing read in the order given: of the failed GETs, the one serving the lowest.
  size_t worst = reqs.size();
  for (size_t j = 0; j < reqs.size(); ++j) {
    if (!reqs[j].status.ok() && (worst == reqs.size() || first_read[j] < first_read[worst])) worst = j;
  }
  if (worst == reqs.size()) return Status::Ok();
  if (failed_index) *failed_index = first_read[worst];
  return reqs[worst].status;
}

Result<ListPage> Client::ListObjectsPage(const std::string& bucket, const std::string& prefix,
                                         const std::string& delimiter, int max_keys,
                                         const std::string& continuation_token) {
  std::map<std::string, std::string> q{{"list-type", "2"}, {"max-keys", std::to_string(std::clamp(max_keys, 1, 1000))}};
  if (!prefix.empty()) q["prefix"] = prefix;
  if (!delimiter.empty()) q["delimiter"] = delimiter;
  if (!continuation_token.empty()) q["continuation-token"] = continuation_token;
  UCPFS_ASSIGN_OR_RETURN(Request r, MakeRequest(options_, Kind::kText, "GET", bucket, "", std::move(q),
                                                "ListObjectsV2 prefix '" + prefix + "'"));
  UCPFS_RETURN_IF_ERROR(impl_->ExecuteOne(r));
  return ParseListObjectsV2(r.text, r.what);
}

Result<Listing> Client::ListObjects(const std::string& bucket, const std::string& prefix, const std::string& delimiter,
                                    int max_keys_per_page, uint64_t max_entries) {
  Listing all;
  std::string token;
  do {
    UCPFS_ASSIGN_OR_RETURN(ListPage page, ListObjectsPage(bucket, prefix, delimiter, max_keys_per_page, token));
    if (all.objects.size() + all.common_prefixes.size() + page.objects.size() + page.common_prefixes.size() > max_entries) {
      return ResourceExhaustedError(S3Name(bucket, prefix) + ": more than " + std::to_string(max_entries) +
                                    " objects and prefixes listed");
    }
    for (auto& o : page.objects) all.objects.push_back(std::move(o));
    for (auto& p : page.common_prefixes) all.common_prefixes.push_back(std::move(p));
    // A server repeating its token would loop forever.
    if (page.is_truncated && page.next_continuation_token == token) {
      return CorruptError(S3Name(bucket, prefix) + ": ListObjectsV2 gave the same continuation token twice");
    }
    token = page.is_truncated ? page.next_continuation_token : "";
  } while (!token.empty());
  return all;
}

Result<std::string> Client::PutObject(const std::string& bucket, const std::string& key, std::span<const std::byte> body) {
  UCPFS_ASSIGN_OR_RETURN(Request r, MakeRequest(options_, Kind::kText, "PUT", bucket, key, {}, "PUT " + std::to_string(body.size()) + " bytes"));
  r.body = body;
  UCPFS_RETURN_IF_ERROR(impl_->ExecuteWrite(r));
  return r.etag;
}

Status Client::DeleteObject(const std::string& bucket, const std::string& key) {
  UCPFS_ASSIGN_OR_RETURN(Request r, MakeRequest(options_, Kind::kText, "DELETE", bucket, key, {}, "DELETE"));
  return impl_->ExecuteWrite(r);
}

Status Client::CreateBucket(const std::string& bucket) {
  UCPFS_ASSIGN_OR_RETURN(Request r, MakeRequest(options_, Kind::kText, "PUT", bucket, "", {}, "CreateBucket"));
  return impl_->ExecuteWrite(r);
}

Status Client::DeleteBucket(const std::string& bucket) {
  UCPFS_ASSIGN_OR_RETURN(Request r, MakeRequest(options_, Kind::kText, "DELETE", bucket, "", {}, "DeleteBucket"));
  return impl_->ExecuteWrite(r);
}

Result<std::string> Client::CreateMultipartUpload(const std::string& bucket, const std::string& key) {
  UCPFS_ASSIGN_OR_RETURN(Request r, MakeRequest(options_, Kind::kText, "POST", bucket, key, {{"uploads", ""}}, "CreateMultipartUpload"));
  UCPFS_RETURN_IF_ERROR(impl_->ExecuteOne(r));
  return ParseInitiateMultipartUpload(r.text, r.what);
}

Result<std::string> Client::UploadPart(const std::string& bucket, const std::string& key, const std::string& upload_id,
                                       int part_number, std::span<const std::byte> body) {
  if (part_number < 1 || part_number > 10000) {
    return InvalidArgumentError(S3Name(bucket, key) + ": part number " + std::to_string(part_number) + " not in 1..10000");
  }
  UCPFS_ASSIGN_OR_RETURN(Request r, MakeRequest(options_, Kind::kText, "PUT", bucket, key,
                          {{"partNumber", std::to_string(part_number)}, {"uploadId", upload_id}},
                          "UploadPart " + std::to_string(part_number)));
  r.body = body;
  UCPFS_RETURN_IF_ERROR(impl_->ExecuteOne(r));
  if (r.etag.empty()) return CorruptError(r.what + ": the answer has no ETag");
  return r.etag;
}

Result<std::string> Client::CompleteMultipartUpload(const std::string& bucket, const std::string& key,
                                                    const std::string& upload_id,
                                                    const std::vector<CompletedPart>& parts) {
  for (size_t i = 1; i < parts.size(); ++i) {
    if (parts[i].part_number <= parts[i - 1].part_number) {
      return InvalidArgumentError(S3Name(bucket, key) + ": parts not in increasing order of part number");
    }
  }
  std::string body = CompleteMultipartUploadBody(parts);
  // S3 may answer 200 and then an <Error> (InternalError) when assembling fails: tried again
  // like a 500, as the SDKs do.
  for (int attempt = 1;; ++attempt) {
    UCPFS_ASSIGN_OR_RETURN(Request r, MakeRequest(options_, Kind::kText, "POST", bucket, key, {{"uploadId", upload_id}},
                            "CompleteMultipartUpload of " + std::to_string(parts.size()) + " parts"));
    r.body = std::as_bytes(std::span<const char>(body.data(), body.size()));
    r.headers.push_back("Content-Type: application/xml");
    UCPFS_RETURN_IF_ERROR(impl_->ExecuteWrite(r));
    ErrorBody eb;
    UCPFS_ASSIGN_OR_RETURN(std::string etag, ParseCompleteMultipartUpload(r.text, r.what, &eb));
    if (eb.code.empty()) {
      if (!etag.empty()) return etag;
      // RGW 16.2 answers an empty <ETag>: ask for it (another writer may have replaced the object
      // in between; the caller records what it will read, so that is still the truth it reads).
      UCPFS_ASSIGN_OR_RETURN(ObjectInfo info, Head(bucket, key));
      return info.etag;
    }
    if (IsRetryable(0, 500, eb.code) && eb.code == "InternalError" && attempt < options_.retry.max_attempts) {
      impl_->retries++;
      std::this_thread::sleep_for(std::chrono::milliseconds(BackoffDelayMs(options_.retry, attempt, UnitRandom())));
      continue;
    }
    return IoError(r.what + ": HTTP 200 with error " + eb.code + (eb.message.empty() ? "" : ": " + eb.message), EIO);
  }
}

Status Client::AbortMultipartUpload(const std::string& bucket, const std::string& key, const std::string& upload_id) {
  UCPFS_ASSIGN_OR_RETURN(Request r, MakeRequest(options_, Kind::kText, "DELETE", bucket, key, {{"uploadId", upload_id}},
                          "AbortMultipartUpload"));
  return impl_->ExecuteOne(r);
}

Result<std::vector<UploadEntry>> Client::ListMultipartUploads(const std::string& bucket, const std::string& prefix,
                                                              uint64_t max_entries) {
  std::vector<UploadEntry> all;
  std::string key_marker, id_marker;
  for (;;) {
    std::map<std::string, std::string> q{{"uploads", ""}};
    if (!prefix.empty()) q["prefix"] = prefix;
    if (!key_marker.empty()) q["key-marker"] = key_marker;
    if (!id_marker.empty()) q["upload-id-marker"] = id_marker;
    UCPFS_ASSIGN_OR_RETURN(Request r, MakeRequest(options_, Kind::kText, "GET", bucket, "", std::move(q),
                            "ListMultipartUploads prefix '" + prefix + "'"));
    UCPFS_RETURN_IF_ERROR(impl_->ExecuteOne(r));
    UCPFS_ASSIGN_OR_RETURN(UploadsPage page, ParseListMultipartUploads(r.text, r.what));
    if (all.size() + page.uploads.size() > max_entries) {
      return ResourceExhaustedError(S3Name(bucket, prefix) + ": more than " + std::to_string(max_entries) + " uploads");
    }
    for (auto& u : page.uploads) all.push_back(std::move(u));
    if (!page.is_truncated) break;
    if (page.next_key_marker == key_marker && page.next_upload_id_marker == id_marker) {
      return CorruptError(r.what + ": the same markers twice");
    }
    key_marker = page.next_key_marker;
    id_marker = page.next_upload_id_marker;
  }
  return all;
}

// ---- S3ObjectSource ----

S3ObjectSource::S3ObjectSource(std::shared_ptr<Client> client, std::string bucket, std::string key, uint64_t n_bytes,
                               std::string etag)
    : client_(std::move(client)), bucket_(std::move(bucket)), key_(std::move(key)), n_bytes_(n_bytes),
      etag_(std::move(etag)), name_(S3Name(bucket_, key_)) {}

Result<std::shared_ptr<S3ObjectSource>> S3ObjectSource::Open(std::shared_ptr<Client> client, const std::string& bucket,
                                                             const std::string& key) {
  UCPFS_ASSIGN_OR_RETURN(ObjectInfo info, client->Head(bucket, key));
  return std::shared_ptr<S3ObjectSource>(new S3ObjectSource(std::move(client), bucket, key, info.n_bytes, info.etag));
}

std::shared_ptr<S3ObjectSource> S3ObjectSource::FromRecorded(std::shared_ptr<Client> client, const std::string& bucket,
                                                             const std::string& key, uint64_t n_bytes,
                                                             std::string etag) {
  return std::shared_ptr<S3ObjectSource>(new S3ObjectSource(std::move(client), bucket, key, n_bytes, std::move(etag)));
}

Status S3ObjectSource::Explain(Status st) const {
  if (etag_.empty()) return st;
  if (st.code() != StatusCode::kDataLoss && st.code() != StatusCode::kNotFound) return st;
  // The object is not the recorded one any more: say what changed, as a local file's identity
  // check does ("size 10 -> 12").
  auto now = client_->Head(bucket_, key_);
  std::string what;
  if (!now.ok() && now.error().code() == StatusCode::kNotFound) {
    what = "it no longer exists";
  } else if (now.ok()) {
    what = "ETag " + etag_ + " -> " + now->etag;
    if (now->n_bytes != n_bytes_) what += ", size " + std::to_string(n_bytes_) + " -> " + std::to_string(now->n_bytes);
  } else {
    what = "the ETag no longer matches";
  }
  return Status(StatusCode::kDataLoss,
                name_ + ": the object changed since it was recorded: " + what + " [" + st.message() + "]");
}

Status S3ObjectSource::ReadAt(uint64_t byte_offset, std::span<std::byte> out) const {
  if (byte_offset > n_bytes_ || out.size() > n_bytes_ - byte_offset) {
    return OutOfRangeError(name_ + ": read of " + std::to_string(out.size()) + " bytes at offset " +
                           std::to_string(byte_offset) + " past the size " + std::to_string(n_bytes_));
  }
  Status st = client_->GetRange(bucket_, key_, byte_offset, out, etag_);
  return st.ok() ? st : Explain(st);
}

Status S3ObjectSource::ReadPieces(std::span<const ReadPiece> pieces, size_t* failed_index) const {
  std::vector<RangeRead> reads;
  reads.reserve(pieces.size());
  for (size_t i = 0; i < pieces.size(); ++i) {
    const ReadPiece& p = pieces[i];
    if (p.byte_offset > n_bytes_ || p.out.size() > n_bytes_ - p.byte_offset) {
      if (failed_index) *failed_index = i;
      return OutOfRangeError(name_ + ": read of " + std::to_string(p.out.size()) + " bytes at offset " +
                             std::to_string(p.byte_offset) + " past the size " + std::to_string(n_bytes_));
    }
    reads.push_back(RangeRead{bucket_, key_, p.byte_offset, p.out, etag_});
  }
  Status st = client_->GetRanges(reads, failed_index);
  return st.ok() ? st : Explain(st);
}

}  // namespace ucpfs::s3
