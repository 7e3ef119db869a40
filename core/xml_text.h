// XML text for what ucpfs writes as XML (the plan's SVG picture, S3 request bodies): the five
// markup characters escaped, and the control characters XML 1.0 forbids even escaped written
// as '?' (names come from untrusted checkpoints and servers).
#pragma once

#include <string>
#include <string_view>

namespace ucpfs {

inline std::string XmlEscape(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (char c : text) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      case '\'': out += "&apos;"; break;
      default: out += (static_cast<unsigned char>(c) < 0x20 && c != '\t' && c != '\n' && c != '\r') ? '?' : c;
    }
  }
  return out;
}

}  // namespace ucpfs
