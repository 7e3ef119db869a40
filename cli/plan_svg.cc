#include "cli/plan_svg.h"

#include <algorithm>
#include <cstdio>
#include <sstream>

#include "cli/text.h"
#include "core/xml_text.h"

namespace ucpfs::cli {
namespace {

constexpr double kWidth = 1100;
constexpr double kLeftX = 330;   // source boxes
constexpr double kRightX = 754;  // rank boxes
constexpr double kBoxW = 16;
constexpr double kTop = 92;  // under the title and two subtitle lines
constexpr double kGap = 5;
constexpr double kMinSlot = 15;  // room for one label line

std::string Num(double v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.1f", v);
  return buf;
}

std::string Color(size_t i, bool muted) {
  if (muted) return "#9e9e9e";
  // Golden-angle hues: neighbours differ.
  const int hue = static_cast<int>((static_cast<double>(i) * 137.508)) % 360;
  return "hsl(" + std::to_string(hue) + ",62%,48%)";
}

// The subtitle as <text> lines at y = 50 and 65: split after its first "; " (the summary's
// second half) so it fits the width.
std::string SubtitleLines(const std::string& subtitle) {
  const size_t cut = subtitle.find("; ");
  const std::string first = cut == std::string::npos ? subtitle : subtitle.substr(0, cut + 1);
  const std::string second = cut == std::string::npos ? "" : subtitle.substr(cut + 2);
  std::string out = "<text x=\"20\" y=\"50\" font-size=\"12\" fill=\"#444\">" + XmlEscape(first) + "</text>\n";
  if (!second.empty()) {
    out += "<text x=\"20\" y=\"65\" font-size=\"12\" fill=\"#444\">" + XmlEscape(second) + "</text>\n";
  }
  return out;
}

struct Placed {
  double y = 0;  // box top
  double h = 0;  // box height (proportional to bytes)
  double slot = 0;
};

std::vector<Placed> Place(const std::vector<FlowPicture::Node>& nodes, double scale, double* height) {
  std::vector<Placed> out;
  double y = kTop;
  for (const auto& n : nodes) {
    Placed p;
    p.h = std::max(1.0, static_cast<double>(n.n_bytes) * scale);
    p.slot = std::max(p.h, kMinSlot);
    p.y = y + (p.slot - p.h) / 2;
    out.push_back(p);
    y += p.slot + kGap;
  }
  *height = y - kTop;
  return out;
}

}  // namespace

std::string RenderFlowSvg(const FlowPicture& pic) {
  uint64_t total = 0;
  for (const auto& f : pic.flows) total += f.n_bytes;
  const size_t n_max = std::max(pic.sources.size(), pic.ranks.size());
  const double band_px = std::max(360.0, 13.0 * static_cast<double>(n_max));
  const double scale = total > 0 ? band_px / static_cast<double>(total) : 0;
  double h_src = 0, h_rank = 0;
  const auto src = Place(pic.sources, scale, &h_src);
  const auto rank = Place(pic.ranks, scale, &h_rank);
  const double height = kTop + std::max(h_src, h_rank) + 40;

  std::ostringstream s;
  s << "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
    << "<svg xmlns=\"http://www.w3.org/2000/svg\" version=\"1.1\" width=\"" << Num(kWidth) << "\" height=\""
    << Num(height) << "\" viewBox=\"0 0 " << Num(kWidth) << ' ' << Num(height) << "\" "
    << "font-family=\"DejaVu Sans, Helvetica, Arial, sans-serif\">\n"
    << "<title>" << XmlEscape(pic.title) << "</title>\n"
    << "<rect width=\"100%\" height=\"100%\" fill=\"#ffffff\"/>\n"
    << "<text x=\"20\" y=\"28\" font-size=\"17\" font-weight=\"bold\">" << XmlEscape(pic.title) << "</text>\n"
    << SubtitleLines(pic.subtitle)
    << "<text x=\"" << Num(kLeftX + kBoxW) << "\" y=\"" << Num(kTop - 8)
    << "\" font-size=\"11\" text-anchor=\"end\" fill=\"#666\">source files</text>\n"
    << "<text x=\"" << Num(kRightX) << "\" y=\"" << Num(kTop - 8)
    << "\" font-size=\"11\" fill=\"#666\">target ranks</text>\n";

  // Bands: stacked in rank order at each source and in source order at each rank.
  std::vector<size_t> order(pic.flows.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::vector<double> at_src(pic.sources.size()), at_rank(pic.ranks.size());
  for (size_t i = 0; i < src.size(); ++i) at_src[i] = src[i].y;
  for (size_t i = 0; i < rank.size(); ++i) at_rank[i] = rank[i].y;
  std::vector<double> y_src(pic.flows.size()), y_rank(pic.flows.size());
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return pic.flows[a].rank < pic.flows[b].rank; });
  for (size_t i : order) {
    y_src[i] = at_src[pic.flows[i].source];
    at_src[pic.flows[i].source] += static_cast<double>(pic.flows[i].n_bytes) * scale;
  }
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return pic.flows[a].source < pic.flows[b].source; });
  for (size_t i : order) {
    y_rank[i] = at_rank[pic.flows[i].rank];
    at_rank[pic.flows[i].rank] += static_cast<double>(pic.flows[i].n_bytes) * scale;
  }
  const double x1 = kLeftX + kBoxW, x2 = kRightX, xm = (x1 + x2) / 2;
  s << "<g fill-opacity=\"0.45\">\n";
  for (size_t i = 0; i < pic.flows.size(); ++i) {
    const auto& f = pic.flows[i];
    const double w = std::max(0.6, static_cast<double>(f.n_bytes) * scale);
    const double a = y_src[i], b = y_rank[i];
    s << "<path fill=\"" << Color(f.source, pic.sources[f.source].muted) << "\" d=\"M" << Num(x1) << ',' << Num(a)
      << " C" << Num(xm) << ',' << Num(a) << ' ' << Num(xm) << ',' << Num(b) << ' ' << Num(x2) << ',' << Num(b)
      << " L" << Num(x2) << ',' << Num(b + w) << " C" << Num(xm) << ',' << Num(b + w) << ' ' << Num(xm) << ','
      << Num(a + w) << ' ' << Num(x1) << ',' << Num(a + w) << " Z\"><title>"
      << XmlEscape(pic.sources[f.source].label + " -> " + pic.ranks[f.rank].label + ": " + HumanBytes(f.n_bytes) +
                   " (" + std::to_string(f.n_bytes) + " bytes)")
      << "</title></path>\n";
  }
  s << "</g>\n<g font-size=\"9\" fill=\"#222\" text-anchor=\"end\">\n";
  for (size_t i = 0; i < pic.flows.size(); ++i) {
    const double w = static_cast<double>(pic.flows[i].n_bytes) * scale;
    if (w < 10) continue;  // too thin to hold a label: its <title> says it
    s << "<text x=\"" << Num(x2 - 4) << "\" y=\"" << Num(y_rank[i] + w / 2 + 3) << "\">"
      << XmlEscape(HumanBytes(pic.flows[i].n_bytes)) << "</text>\n";
  }
  s << "</g>\n";
  auto nodes = [&](const std::vector<FlowPicture::Node>& list, const std::vector<Placed>& placed, double x, bool left) {
    for (size_t i = 0; i < list.size(); ++i) {
      const auto& n = list[i];
      const auto& p = placed[i];
      const std::string fill = left ? Color(i, n.muted) : std::string("#37474f");
      s << "<rect x=\"" << Num(x) << "\" y=\"" << Num(p.y) << "\" width=\"" << Num(kBoxW) << "\" height=\""
        << Num(p.h) << "\" fill=\"" << fill << "\"><title>" << XmlEscape(n.label + ": " + std::to_string(n.n_bytes) + " bytes")
        << "</title></rect>\n";
      const double ty = p.y + p.h / 2 + 4;
      if (left) {
        s << "<text x=\"" << Num(x - 6) << "\" y=\"" << Num(ty) << "\" font-size=\"11\" text-anchor=\"end\">"
          << XmlEscape(n.label) << " <tspan fill=\"#666\">" << XmlEscape(HumanBytes(n.n_bytes)) << "</tspan></text>\n";
      } else {
        s << "<text x=\"" << Num(x + kBoxW + 6) << "\" y=\"" << Num(ty) << "\" font-size=\"11\">" << XmlEscape(n.label)
          << " <tspan fill=\"#666\">" << XmlEscape(HumanBytes(n.n_bytes)) << "</tspan></text>\n";
      }
    }
  };
  nodes(pic.sources, src, kLeftX, true);
  nodes(pic.ranks, rank, kRightX, false);
  s << "</svg>\n";
  return s.str();
}

}  // namespace ucpfs::cli
