#include "cli/plan_cmd.h"

#include <CLI/CLI.hpp>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <numeric>
#include <sstream>
#include <string_view>

#include <nlohmann/json.hpp>

#include "cli/plan_svg.h"
#include "cli/text.h"
#include "cli/checkpoint_cmds.h"
#include "cli/view_args.h"
#include "views/view_kind.h"
#include "core/json_text.h"
#include "views/reshard_reads.h"

namespace ucpfs::cli {
namespace {

constexpr size_t kMaxColumns = 8;       // source-file columns of the text table
constexpr size_t kMaxSvgSources = 30;   // source boxes in the picture (the rest: "other")
constexpr size_t kMaxSvgRanks = 64;     // rank boxes (more ranks: consecutive ones grouped)
constexpr size_t kMaxLabelChars = 44;

int Fail(const Status& s) {
  std::cerr << "ucpfs plan: " << s.ToString() << '\n';
  return 1;
}

std::string Ratio(uint64_t num, uint64_t den) {
  std::ostringstream s;
  s << std::fixed << std::setprecision(2) << (den ? static_cast<double>(num) / static_cast<double>(den) : 0.0) << 'x';
  return s.str();
}

// "…" + the end of a long name (the file name is at the end).
std::string Shorten(const std::string& s, size_t n = kMaxLabelChars) {
  return s.size() <= n ? s : "..." + s.substr(s.size() - (n - 3));
}

struct Names {
  std::vector<std::string> path;  // per source file id
  std::vector<size_t> read;       // ids of the files the layout reads, in NaturalLess order of path
};

// "__2_0.distcp" before "__10_0.distcp": runs of digits compare as numbers, the rest as text, so
// the table's columns (and their groups) follow the ranks' and files' numbers.
bool NaturalLess(const std::string& a, const std::string& b) {
  size_t i = 0, j = 0;
  while (i < a.size() && j < b.size()) {
    const bool da = std::isdigit(static_cast<unsigned char>(a[i])) != 0;
    const bool db = std::isdigit(static_cast<unsigned char>(b[j])) != 0;
    if (da && db) {
      size_t ie = i, je = j;
      while (ie < a.size() && std::isdigit(static_cast<unsigned char>(a[ie])) != 0) ++ie;
      while (je < b.size() && std::isdigit(static_cast<unsigned char>(b[je])) != 0) ++je;
      std::string_view x(a.data() + i, ie - i), y(b.data() + j, je - j);
      while (x.size() > 1 && x.front() == '0') x.remove_prefix(1);
      while (y.size() > 1 && y.front() == '0') y.remove_prefix(1);
      if (x.size() != y.size()) return x.size() < y.size();
      if (x != y) return x < y;
      i = ie;
      j = je;
    } else {
      if (a[i] != b[j]) return a[i] < b[j];
      ++i;
      ++j;
    }
  }
  return a.size() - i < b.size() - j;
}

std::string Summary(const views::ReshardReads& r, const Names& names) {
  uint64_t distinct = 0;
  int fan_out = 0;
  for (const auto& s : r.sources) {
    distinct += s.distinct_n_bytes;
    fan_out = std::max(fan_out, s.fan_out);
  }
  std::ostringstream o;
  o << r.ranks.size() << " ranks read " << names.read.size() << " of " << names.path.size() << " source files: "
    << HumanBytes(r.ReadTotal()) << " read for " << HumanBytes(r.PayloadTotal()) << " of tensor data in "
    << HumanBytes(r.FileTotal()) << " of rank files (read amplification " << Ratio(r.ReadTotal(), r.PayloadTotal())
    << "); " << HumanBytes(distinct) << " distinct source bytes, each read " << Ratio(r.ReadTotal(), distinct)
    << " on average, a file by up to " << fan_out << (fan_out == 1 ? " rank" : " ranks");
  return o.str();
}

void PrintTable(const views::ReshardReads& r, const Names& names, const std::string& src, std::ostream& out) {
  // Columns: each read file, or groups of consecutive read files when there are too many.
  std::vector<std::vector<size_t>> cols;
  const size_t per = (names.read.size() + kMaxColumns - 1) / kMaxColumns;
  for (size_t i = 0; i < names.read.size(); i += std::max<size_t>(per, 1)) {
    cols.emplace_back(names.read.begin() + static_cast<std::ptrdiff_t>(i),
                      names.read.begin() + static_cast<std::ptrdiff_t>(std::min(names.read.size(), i + std::max<size_t>(per, 1))));
  }
  const bool grouped = per > 1;
  std::vector<std::string> header = {"rank"};
  for (size_t c = 0; c < cols.size(); ++c) {
    header.push_back(grouped ? "files g" + std::to_string(c + 1) : Shorten(names.path[cols[c].front()], 24));
  }
  header.push_back("read");
  header.push_back("rank files");
  std::vector<std::vector<std::string>> rows;
  std::vector<uint64_t> col_total(cols.size(), 0);
  for (const auto& rank : r.ranks) {
    std::vector<std::string> row = {std::to_string(rank.rank)};
    for (size_t c = 0; c < cols.size(); ++c) {
      uint64_t n = 0;
      for (size_t id : cols[c]) n += rank.read_n_bytes[id];
      col_total[c] += n;
      row.push_back(n ? HumanBytes(n) : "-");
    }
    row.push_back(HumanBytes(rank.ReadTotal()));
    row.push_back(HumanBytes(rank.FileTotal()));
    rows.push_back(std::move(row));
  }
  std::vector<std::string> total = {"total"};
  for (uint64_t n : col_total) total.push_back(HumanBytes(n));
  total.push_back(HumanBytes(r.ReadTotal()));
  total.push_back(HumanBytes(r.FileTotal()));
  std::vector<size_t> width(header.size(), 0);
  for (const auto* row : {&header, &total}) {
    for (size_t i = 0; i < row->size(); ++i) width[i] = std::max(width[i], (*row)[i].size());
  }
  for (const auto& row : rows) {
    for (size_t i = 0; i < row.size(); ++i) width[i] = std::max(width[i], row[i].size());
  }
  auto print = [&](const std::vector<std::string>& row) {
    for (size_t i = 0; i < row.size(); ++i) {
      out << (i ? "  " : "") << (i ? std::right : std::left) << std::setw(static_cast<int>(width[i])) << row[i];
    }
    out << std::left << '\n';
  };
  out << "ucpfs plan: layout " << r.layout << " of " << src << " (bytes each target rank reads from each source file)\n";
  print(header);
  for (const auto& row : rows) print(row);
  print(total);
  if (grouped) {
    out << names.read.size() << " source files grouped into " << cols.size() << " columns of up to " << per << ":\n";
    for (size_t c = 0; c < cols.size(); ++c) {
      out << "  g" << (c + 1) << ": " << names.path[cols[c].front()];
      if (cols[c].size() > 1) out << " .. " << names.path[cols[c].back()] << " (" << cols[c].size() << " files)";
      out << '\n';
    }
  }
  out << Summary(r, names) << '\n';
}

nlohmann::ordered_json Json(const views::ReshardReads& r, const Names& names, const std::string& src,
                            const std::vector<uint64_t>& sizes) {
  nlohmann::ordered_json j;
  j["layout"] = r.layout;
  j["source"] = src;
  auto files = nlohmann::ordered_json::array();
  for (size_t i = 0; i < names.path.size(); ++i) {
    const auto& s = r.sources[i];
    files.push_back({{"path", names.path[i]}, {"size", sizes[i]}, {"read_bytes", s.read_n_bytes},
                     {"distinct_bytes", s.distinct_n_bytes}, {"distinct_exact", s.distinct_exact},
                     {"fan_out", s.fan_out}});
  }
  j["source_files"] = std::move(files);
  auto reads_of = [&](const std::vector<uint64_t>& v) {
    nlohmann::ordered_json o = nlohmann::ordered_json::object();
    for (size_t i = 0; i < v.size(); ++i) {
      if (v[i]) o[names.path[i]] = v[i];
    }
    return o;
  };
  auto ranks = nlohmann::ordered_json::array();
  for (const auto& rank : r.ranks) {
    auto fl = nlohmann::ordered_json::array();
    for (const auto& f : rank.files) {
      fl.push_back({{"name", f.name}, {"size", f.file_n_bytes}, {"payload_bytes", f.payload_n_bytes},
                    {"zero_bytes", f.zero_n_bytes}, {"converted_bytes", f.converted_n_bytes},
                    {"read_bytes", std::accumulate(f.read_n_bytes.begin(), f.read_n_bytes.end(), uint64_t{0})},
                    {"reads", reads_of(f.read_n_bytes)}});
    }
    ranks.push_back({{"rank", rank.rank}, {"read_bytes", rank.ReadTotal()}, {"file_bytes", rank.FileTotal()},
                     {"payload_bytes", rank.PayloadTotal()}, {"reads", reads_of(rank.read_n_bytes)},
                     {"files", std::move(fl)}});
  }
  j["ranks"] = std::move(ranks);
  uint64_t distinct = 0;
  for (const auto& s : r.sources) distinct += s.distinct_n_bytes;
  j["totals"] = {{"ranks", r.ranks.size()}, {"source_files_read", names.read.size()},
                 {"read_bytes", r.ReadTotal()}, {"file_bytes", r.FileTotal()}, {"payload_bytes", r.PayloadTotal()},
                 {"distinct_bytes", distinct},
                 {"read_amplification", r.PayloadTotal() ? static_cast<double>(r.ReadTotal()) / static_cast<double>(r.PayloadTotal()) : 0.0},
                 {"reads_per_distinct_byte", distinct ? static_cast<double>(r.ReadTotal()) / static_cast<double>(distinct) : 0.0}};
  return j;
}

FlowPicture Picture(const views::ReshardReads& r, const Names& names, const std::string& src) {
  FlowPicture pic;
  pic.title = "ucpfs plan: " + r.layout + " of " + Shorten(src, 70);
  pic.subtitle = Summary(r, names);
  // Sources: the most read ones, then "other" for the rest; zero fill as a grey source.
  std::vector<size_t> by_size = names.read;
  std::stable_sort(by_size.begin(), by_size.end(),
                   [&](size_t a, size_t b) { return r.sources[a].read_n_bytes > r.sources[b].read_n_bytes; });
  const size_t keep = by_size.size() <= kMaxSvgSources ? by_size.size() : kMaxSvgSources - 1;
  std::vector<size_t> kept(by_size.begin(), by_size.begin() + static_cast<std::ptrdiff_t>(keep));
  std::sort(kept.begin(), kept.end(), [&](size_t a, size_t b) { return NaturalLess(names.path[a], names.path[b]); });
  std::vector<size_t> node_of(names.path.size(), SIZE_MAX);
  for (size_t k = 0; k < kept.size(); ++k) {
    node_of[kept[k]] = k;
    pic.sources.push_back({Shorten(names.path[kept[k]]), r.sources[kept[k]].read_n_bytes, false});
  }
  if (keep < by_size.size()) {
    uint64_t n = 0;
    for (size_t i = keep; i < by_size.size(); ++i) n += r.sources[by_size[i]].read_n_bytes;
    for (size_t i = keep; i < by_size.size(); ++i) node_of[by_size[i]] = pic.sources.size();
    pic.sources.push_back({"other (" + std::to_string(by_size.size() - keep) + " files)", n, true});
  }
  uint64_t zeros_total = 0;
  for (const auto& rank : r.ranks) {
    for (const auto& f : rank.files) zeros_total += f.zero_n_bytes;
  }
  const size_t zero_node = pic.sources.size();
  if (zeros_total) pic.sources.push_back({"zeros (padding, absent states)", zeros_total, true});
  // Ranks: one box each, or consecutive ranks grouped.
  const size_t per = (r.ranks.size() + kMaxSvgRanks - 1) / kMaxSvgRanks;
  std::vector<std::vector<uint64_t>> flow;  // [rank node][source node]
  for (size_t i = 0; i < r.ranks.size(); i += per) {
    const size_t end = std::min(r.ranks.size(), i + per);
    FlowPicture::Node node;
    node.label = per == 1 ? "rank " + std::to_string(i) : "ranks " + std::to_string(i) + "-" + std::to_string(end - 1);
    std::vector<uint64_t> row(pic.sources.size(), 0);
    for (size_t k = i; k < end; ++k) {
      const auto& rank = r.ranks[k];
      for (size_t id = 0; id < rank.read_n_bytes.size(); ++id) {
        if (rank.read_n_bytes[id]) row[node_of[id]] += rank.read_n_bytes[id];
      }
      for (const auto& f : rank.files) {
        if (f.zero_n_bytes) row[zero_node] += f.zero_n_bytes;
      }
    }
    for (uint64_t n : row) node.n_bytes += n;
    pic.ranks.push_back(std::move(node));
    flow.push_back(std::move(row));
  }
  for (size_t rk = 0; rk < flow.size(); ++rk) {
    for (size_t s = 0; s < flow[rk].size(); ++s) {
      if (flow[rk][s]) pic.flows.push_back({s, rk, flow[rk][s]});
    }
  }
  return pic;
}

}  // namespace

CLI::App* AddPlanCommand(CLI::App& app, PlanArgs& args) {
  CLI::App* cmd = app.add_subcommand(
      "plan", "Show which source files feed which ranks of a layout, and how many bytes (from the index; reads no tensor data)");
  cmd->add_option("SRC", args.source.src, "checkpoint directory")->required();
  cmd->add_option("--layout", args.layout, "target layout tp<T>_pp<P>_dp<D>[_ep<E>][_zero1]")->required();
  cmd->add_flag("--json", args.json, "print the exact byte matrix as JSON instead of the table");
  cmd->add_option("--svg", args.svg, "also write a diagram (SVG 1.1) of the flows to FILE");
  AddPatternOptions(cmd, args.preset, args.pattern_rules, args.pp_split, args.vocab_pad_multiple);
  return cmd;
}

int RunPlan(const PlanArgs& args) {
  ViewArgs view_args;
  view_args.layouts = {args.layout};
  view_args.preset = args.preset;
  view_args.pattern_rules = args.pattern_rules;
  view_args.pp_split = args.pp_split;
  view_args.vocab_pad_multiple = args.vocab_pad_multiple;
  auto selection = ParseViewArgs(view_args);
  if (!selection.ok()) return Fail(selection.error());
  auto snapshot = OpenSourceSnapshot(args.source);
  if (!snapshot.ok()) return Fail(snapshot.error());
  const index::Snapshot& snap = **snapshot;
  // The input target/ plans its layouts from (views/view_kind.h), so the plan is the mount's.
  auto base = views::ViewBaseOf(snap, selection->options);
  if (!base.ok()) return Fail(base.error());
  auto input = views::TargetInputOf(*snapshot, selection->options, base->patterns,
                                    [](const std::string&) {});  // `ucpfs inspect` lists them
  if (!input.ok()) return Fail(input.error());
  const layout::Layout& l = selection->options.layouts.front();
  auto plan = views::TargetPlan::Make(*input, l);
  if (!plan.ok()) return Fail(plan.error().WithContext("layout " + l.name));
  auto reads = views::ComputeReshardReads(*plan, *snap.files);
  if (!reads.ok()) return Fail(reads.error());

  Names names;
  std::vector<uint64_t> sizes;
  for (size_t i = 0; i < snap.checkpoint().files.size(); ++i) {
    names.path.push_back(snap.checkpoint().files[i].rel_path);
    sizes.push_back(snap.checkpoint().files[i].n_bytes);
    if (reads->sources[i].read_n_bytes) names.read.push_back(i);
  }
  std::stable_sort(names.read.begin(), names.read.end(),
                   [&](size_t x, size_t y) { return NaturalLess(names.path[x], names.path[y]); });
  const std::string& src = snap.source_dir();
  if (!args.svg.empty()) {
    const std::string svg = RenderFlowSvg(Picture(*reads, names, src));
    std::ofstream f(args.svg, std::ios::binary | std::ios::trunc);
    if (!f || !(f << svg) || !f.flush()) {
      return Fail(IoError(args.svg + ": cannot write: " + std::strerror(errno), errno));
    }
  }
  if (args.json) {
    std::cout << JsonText(Json(*reads, names, src, sizes)) << '\n';
  } else {
    PrintTable(*reads, names, src, std::cout);
    if (!args.svg.empty()) std::cout << "diagram written to " << args.svg << '\n';
  }
  return 0;
}

}  // namespace ucpfs::cli
