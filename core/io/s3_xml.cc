// See s3_xml.h. expat turns the body into a small tree of elements (name, text, children), bounded
// in depth and count; the typed parsers below read fields from it by name.
#include "core/io/s3_xml.h"

#include <expat.h>

#include <limits>

namespace ucpfs::s3 {
namespace {

constexpr int kMaxDepth = 16;
constexpr size_t kMaxElements = 1000000;
// The tree is kept only for bodies the caller already capped; this bounds text per element too.
constexpr size_t kMaxTextBytes = 1 << 20;

struct Element {
  std::string name;
  std::string text;
  std::vector<size_t> children;
};

struct Tree {
  std::vector<Element> elements;  // [0] is the root once parsed
  std::vector<size_t> stack;
  std::string failure;  // set by a callback that stopped the parser
  bool over_limit = false;  // ... because a bound was reached
  XML_Parser parser = nullptr;

  void Stop(std::string why, bool limit = true) {
    if (failure.empty()) failure = std::move(why);
    over_limit = over_limit || limit;
    XML_StopParser(parser, XML_FALSE);
  }
};

void XMLCALL OnStart(void* data, const XML_Char* name, const XML_Char** /*attrs*/) {
  auto* t = static_cast<Tree*>(data);
  if (!t->failure.empty()) return;
  if (t->stack.size() >= static_cast<size_t>(kMaxDepth)) return t->Stop("elements nest deeper than 16");
  if (t->elements.size() >= kMaxElements) return t->Stop("more than 1,000,000 elements");
  if (t->stack.empty() && !t->elements.empty()) return t->Stop("a second root element", false);
  size_t id = t->elements.size();
  t->elements.push_back(Element{name, {}, {}});
  if (!t->stack.empty()) t->elements[t->stack.back()].children.push_back(id);
  t->stack.push_back(id);
}

void XMLCALL OnEnd(void* data, const XML_Char* /*name*/) {
  auto* t = static_cast<Tree*>(data);
  if (!t->stack.empty()) t->stack.pop_back();
}

void XMLCALL OnText(void* data, const XML_Char* s, int len) {
  auto* t = static_cast<Tree*>(data);
  if (!t->failure.empty() || t->stack.empty() || len <= 0) return;
  std::string& text = t->elements[t->stack.back()].text;
  if (text.size() + static_cast<size_t>(len) > kMaxTextBytes) return t->Stop("an element's text is over 1 MiB");
  text.append(s, static_cast<size_t>(len));
}

// Refuses any DTD: S3 sends none, and a DTD is where entity tricks live.
void XMLCALL OnDoctype(void* data, const XML_Char*, const XML_Char*, const XML_Char*, int) {
  static_cast<Tree*>(data)->Stop("a document type declaration", false);
}

Result<Tree> Parse(std::string_view xml, const std::string& what) {
  if (xml.size() > static_cast<size_t>(std::numeric_limits<int>::max())) {
    return ResourceExhaustedError(what + ": body too large to parse");
  }
  Tree t;
  XML_Parser p = XML_ParserCreate(nullptr);
  if (!p) return ResourceExhaustedError(what + ": cannot create an XML parser");
  t.parser = p;
  XML_SetUserData(p, &t);
  XML_SetElementHandler(p, OnStart, OnEnd);
  XML_SetCharacterDataHandler(p, OnText);
  XML_SetStartDoctypeDeclHandler(p, OnDoctype);
  XML_SetParamEntityParsing(p, XML_PARAM_ENTITY_PARSING_NEVER);
  XML_Status st = XML_Parse(p, xml.data(), static_cast<int>(xml.size()), XML_TRUE);
  std::string err;
  if (!t.failure.empty()) {
    err = t.failure;
  } else if (st != XML_STATUS_OK) {
    err = std::string(XML_ErrorString(XML_GetErrorCode(p))) + " at line " +
          std::to_string(XML_GetCurrentLineNumber(p)) + " column " + std::to_string(XML_GetCurrentColumnNumber(p));
  } else if (t.elements.empty()) {
    err = "no root element";
  }
  XML_ParserFree(p);
  t.parser = nullptr;
  if (!err.empty()) {
    if (t.over_limit) {
      return ResourceExhaustedError(what + ": " + err);
    }
    return CorruptError(what + ": not well-formed XML: " + err);
  }
  return t;
}

const Element* Child(const Tree& t, const Element& e, std::string_view name) {
  for (size_t c : e.children) {
    if (t.elements[c].name == name) return &t.elements[c];
  }
  return nullptr;
}

std::string ChildText(const Tree& t, const Element& e, std::string_view name) {
  const Element* c = Child(t, e, name);
  return c ? c->text : std::string();
}

Status ExpectRoot(const Tree& t, std::string_view name, const std::string& what) {
  if (t.elements[0].name != name) {
    return CorruptError(what + ": root element <" + t.elements[0].name + ">, expected <" + std::string(name) + ">");
  }
  return Status::Ok();
}

Result<uint64_t> ParseU64(const std::string& s, const std::string& what, std::string_view field) {
  if (s.empty() || s.size() > 20) return CorruptError(what + ": <" + std::string(field) + "> '" + s + "' is not a size");
  uint64_t v = 0;
  for (char c : s) {
    if (c < '0' || c > '9') return CorruptError(what + ": <" + std::string(field) + "> '" + s + "' is not a size");
    uint64_t d = static_cast<uint64_t>(c - '0');
    if (v > (std::numeric_limits<uint64_t>::max() - d) / 10) {
      return CorruptError(what + ": <" + std::string(field) + "> '" + s + "' overflows 64 bits");
    }
    v = v * 10 + d;
  }
  return v;
}

Result<bool> ParseBool(const std::string& s, const std::string& what, std::string_view field) {
  if (s == "true") return true;
  if (s == "false" || s.empty()) return false;
  return CorruptError(what + ": <" + std::string(field) + "> '" + s + "' is not true or false");
}

ErrorBody ErrorOf(const Tree& t, const Element& e) {
  return ErrorBody{ChildText(t, e, "Code"), ChildText(t, e, "Message"), ChildText(t, e, "RequestId")};
}

}  // namespace

Result<ErrorBody> ParseErrorBody(std::string_view xml, const std::string& what) {
  UCPFS_ASSIGN_OR_RETURN(Tree t, Parse(xml, what));
  UCPFS_RETURN_IF_ERROR(ExpectRoot(t, "Error", what));
  return ErrorOf(t, t.elements[0]);
}

Result<ListPage> ParseListObjectsV2(std::string_view xml, const std::string& what) {
  UCPFS_ASSIGN_OR_RETURN(Tree t, Parse(xml, what));
  UCPFS_RETURN_IF_ERROR(ExpectRoot(t, "ListBucketResult", what));
  const Element& root = t.elements[0];
  ListPage page;
  UCPFS_ASSIGN_OR_RETURN(page.is_truncated, ParseBool(ChildText(t, root, "IsTruncated"), what, "IsTruncated"));
  page.next_continuation_token = ChildText(t, root, "NextContinuationToken");
  if (page.is_truncated && page.next_continuation_token.empty()) {
    return CorruptError(what + ": <IsTruncated> true without <NextContinuationToken>");
  }
  for (size_t c : root.children) {
    const Element& e = t.elements[c];
    if (e.name == "Contents") {
      ObjectEntry o;
      const Element* key = Child(t, e, "Key");
      if (!key) return CorruptError(what + ": <Contents> without <Key>");
      o.key = key->text;
      UCPFS_ASSIGN_OR_RETURN(o.n_bytes, ParseU64(ChildText(t, e, "Size"), what + ": " + o.key, "Size"));
      o.etag = ChildText(t, e, "ETag");
      o.last_modified = ChildText(t, e, "LastModified");
      page.objects.push_back(std::move(o));
    } else if (e.name == "CommonPrefixes") {
      const Element* prefix = Child(t, e, "Prefix");
      if (!prefix) return CorruptError(what + ": <CommonPrefixes> without <Prefix>");
      page.common_prefixes.push_back(prefix->text);
    }
  }
  return page;
}

Result<UploadsPage> ParseListMultipartUploads(std::string_view xml, const std::string& what) {
  UCPFS_ASSIGN_OR_RETURN(Tree t, Parse(xml, what));
  UCPFS_RETURN_IF_ERROR(ExpectRoot(t, "ListMultipartUploadsResult", what));
  const Element& root = t.elements[0];
  UploadsPage page;
  UCPFS_ASSIGN_OR_RETURN(page.is_truncated, ParseBool(ChildText(t, root, "IsTruncated"), what, "IsTruncated"));
  page.next_key_marker = ChildText(t, root, "NextKeyMarker");
  page.next_upload_id_marker = ChildText(t, root, "NextUploadIdMarker");
  if (page.is_truncated && page.next_key_marker.empty()) {
    return CorruptError(what + ": <IsTruncated> true without <NextKeyMarker>");
  }
  for (size_t c : root.children) {
    const Element& e = t.elements[c];
    if (e.name != "Upload") continue;
    UploadEntry u{ChildText(t, e, "Key"), ChildText(t, e, "UploadId"), ChildText(t, e, "Initiated")};
    if (u.key.empty() || u.upload_id.empty()) return CorruptError(what + ": <Upload> without <Key> or <UploadId>");
    page.uploads.push_back(std::move(u));
  }
  return page;
}

Result<std::string> ParseInitiateMultipartUpload(std::string_view xml, const std::string& what) {
  UCPFS_ASSIGN_OR_RETURN(Tree t, Parse(xml, what));
  UCPFS_RETURN_IF_ERROR(ExpectRoot(t, "InitiateMultipartUploadResult", what));
  std::string id = ChildText(t, t.elements[0], "UploadId");
  if (id.empty()) return CorruptError(what + ": no <UploadId>");
  return id;
}

Result<std::string> ParseCompleteMultipartUpload(std::string_view xml, const std::string& what, ErrorBody* error_body) {
  UCPFS_ASSIGN_OR_RETURN(Tree t, Parse(xml, what));
  const Element& root = t.elements[0];
  if (root.name == "Error") {
    if (error_body) *error_body = ErrorOf(t, root);
    return std::string();
  }
  UCPFS_RETURN_IF_ERROR(ExpectRoot(t, "CompleteMultipartUploadResult", what));
  return ChildText(t, root, "ETag");
}

std::string CompleteMultipartUploadBody(const std::vector<CompletedPart>& parts) {
  std::string body = "<CompleteMultipartUpload xmlns=\"http://s3.amazonaws.com/doc/2006-03-01/\">";
  for (const CompletedPart& p : parts) {
    body += "<Part><PartNumber>" + std::to_string(p.part_number) + "</PartNumber><ETag>" + XmlEscape(p.etag) +
            "</ETag></Part>";
  }
  body += "</CompleteMultipartUpload>";
  return body;
}

}  // namespace ucpfs::s3
