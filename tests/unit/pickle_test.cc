// Tests for the safe pickle reader (core/format/pickle.h): hand-assembled opcode sequences per
// opcode family, real pickles written by CPython (tests/data/pickles/make_pickles.py), a real
// torch 1.13 torch.save data.pkl and DCP .metadata (make_torch_pickles.py), and a catalogue of
// corrupt and hostile inputs that must give a clean Status, never a crash.
#include "core/format/pickle.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <map>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace ucpfs::pickle {
namespace {

// ---------------------------------------------------------------------------------------------
// A tiny pickle assembler.

class Asm {
 public:
  Asm& Op(uint8_t op) {
    b_.push_back(op);
    return *this;
  }
  Asm& Raw(std::string_view s) {
    b_.insert(b_.end(), s.begin(), s.end());
    return *this;
  }
  Asm& LE(uint64_t v, int n) {
    for (int i = 0; i < n; ++i) b_.push_back(static_cast<uint8_t>(v >> (8 * i)));
    return *this;
  }
  Asm& Line(std::string_view s) { return Raw(s).Op('\n'); }

  Asm& Proto(int p) { return Op(0x80).LE(static_cast<uint64_t>(p), 1); }
  Asm& Frame(uint64_t n) { return Op(0x95).LE(n, 8); }
  Asm& Stop() { return Op('.'); }
  Asm& Mark() { return Op('('); }
  Asm& None() { return Op('N'); }
  Asm& True() { return Op(0x88); }
  Asm& False() { return Op(0x89); }
  Asm& Int(int64_t v) {
    if (v >= 0 && v < 256) return Op('K').LE(static_cast<uint64_t>(v), 1);
    if (v >= 0 && v < 65536) return Op('M').LE(static_cast<uint64_t>(v), 2);
    if (v >= INT32_MIN && v <= INT32_MAX) return Op('J').LE(static_cast<uint64_t>(v), 4);
    return Op(0x8a).LE(8, 1).LE(static_cast<uint64_t>(v), 8);  // LONG1, 8 bytes
  }
  Asm& BinFloat(double v) {
    uint64_t bits;
    std::memcpy(&bits, &v, sizeof bits);
    Op('G');
    for (int i = 7; i >= 0; --i) b_.push_back(static_cast<uint8_t>(bits >> (8 * i)));
    return *this;
  }
  Asm& Str(std::string_view s) { return Op('X').LE(s.size(), 4).Raw(s); }  // BINUNICODE
  Asm& ShortStr(std::string_view s) { return Op(0x8c).LE(s.size(), 1).Raw(s); }
  Asm& Bytes(std::string_view s) { return Op('B').LE(s.size(), 4).Raw(s); }
  Asm& Global(std::string_view m, std::string_view n) { return Op('c').Line(m).Line(n); }
  Asm& StackGlobal(std::string_view m, std::string_view n) {
    return ShortStr(m).ShortStr(n).Op(0x93);
  }
  Asm& EmptyTuple() { return Op(')'); }
  Asm& Tuple() { return Op('t'); }
  Asm& Tuple1() { return Op(0x85); }
  Asm& Tuple2() { return Op(0x86); }
  Asm& Tuple3() { return Op(0x87); }
  Asm& EmptyList() { return Op(']'); }
  Asm& Append() { return Op('a'); }
  Asm& Appends() { return Op('e'); }
  Asm& EmptyDict() { return Op('}'); }
  Asm& SetItem() { return Op('s'); }
  Asm& SetItems() { return Op('u'); }
  Asm& Reduce() { return Op('R'); }
  Asm& NewObj() { return Op(0x81); }
  Asm& Build() { return Op('b'); }
  Asm& BinPut(uint8_t i) { return Op('q').LE(i, 1); }
  Asm& BinGet(uint8_t i) { return Op('h').LE(i, 1); }
  Asm& Memoize() { return Op(0x94); }
  Asm& IntTuple(std::initializer_list<int64_t> v) {
    Mark();
    for (int64_t x : v) Int(x);
    return Tuple();
  }
  // BINPERSID ('storage', <module.cls>, key, location, numel)
  Asm& StoragePid(std::string_view module, std::string_view cls, std::string_view key,
                  int64_t numel, std::string_view location = "cpu") {
    return Mark().Str("storage").Global(module, cls).Str(key).Str(location).Int(numel).Tuple()
        .Op('Q');
  }

  std::span<const std::byte> span() const {
    return {reinterpret_cast<const std::byte*>(b_.data()), b_.size()};
  }
  const std::vector<uint8_t>& bytes() const { return b_; }
  size_t size() const { return b_.size(); }

 private:
  std::vector<uint8_t> b_;
};

Result<PickleGraph> Parse(const Asm& a, const PickleLimits& limits = {}) {
  return ParsePickle(a.span(), "test.pkl", limits);
}
Result<PickleGraph> ParseBytes(const std::vector<uint8_t>& b, const PickleLimits& limits = {}) {
  return ParsePickle({reinterpret_cast<const std::byte*>(b.data()), b.size()}, "test.pkl",
                     limits);
}

// ---------------------------------------------------------------------------------------------
// Graph helpers.

// Every id a node refers to (for walkers and invariant checks); kNoNode for absent references.
template <typename F>
void ForEachRef(const PickleGraph& g, NodeId id, F&& f) {
  for (NodeId ref : g.items(id)) f(ref);
  for (const auto& [k, v] : g.dict_items(id)) {
    f(k);
    f(v);
  }
  const ObjectInfo o = g.object(id);
  for (NodeId ref : o.list_items) f(ref);
  for (const auto& [k, v] : o.dict_items) {
    f(k);
    f(v);
  }
  f(o.callable);
  f(o.args);
  f(o.kwargs);
  f(g.state(id));
  f(g.persistent_id(id));
  f(g.tensor(id).storage);
}

std::vector<int64_t> Vec(std::span<const int64_t> v) { return {v.begin(), v.end()}; }

// Iterative walk from the root; checks that every referenced id is valid. Returns the number of
// reachable nodes.
size_t WalkChecked(const PickleGraph& g) {
  if (g.root() == kNoNode) return 0;
  EXPECT_LT(g.root(), g.size());
  std::vector<bool> seen(g.size());
  std::vector<NodeId> todo{g.root()};
  size_t count = 0;
  while (!todo.empty()) {
    NodeId id = todo.back();
    todo.pop_back();
    if (seen[id]) continue;
    seen[id] = true;
    ++count;
    ForEachRef(g, id, [&](NodeId ref) {
      if (ref == kNoNode) return;
      EXPECT_LT(ref, g.size());
      if (ref < g.size() && !seen[ref]) todo.push_back(ref);
    });
  }
  return count;
}

std::string ShortestDouble(double v) {
  char buf[64];
  for (int prec = 1; prec <= 17; ++prec) {
    std::snprintf(buf, sizeof buf, "%.*g", prec, v);
    if (std::strtod(buf, nullptr) == v) break;
  }
  return buf;
}

std::string Quote(std::string_view s, bool bytes) {
  std::string out = bytes ? "b'" : "'";
  for (char c : s) {
    const auto u = static_cast<unsigned char>(c);
    if (c == '\\' || c == '\'') {
      out += '\\';
      out += c;
    } else if (u < 0x20 || u == 0x7f || (bytes && u >= 0x80)) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02x", u);
      out += buf;
    } else {
      out += c;  // UTF-8 passes through for str
    }
  }
  return out + "'";
}

std::string Hex(std::string_view s) {
  std::string out;
  char buf[4];
  for (char c : s) {
    std::snprintf(buf, sizeof buf, "%02x", static_cast<unsigned char>(c));
    out += buf;
  }
  return out;
}

// Python-like rendering of the plain-data part of a graph; objects render as
// Obj(module.name ...). A node already on the current path renders as "<cycle>".
std::string Render(const PickleGraph& g, NodeId id, std::vector<NodeId>& path) {
  if (id == kNoNode) return "<none>";
  for (NodeId p : path) {
    if (p == id) return "<cycle>";
  }
  path.push_back(id);
  std::string s;
  auto list = [&](std::span<const NodeId> items) {
    std::string r;
    for (size_t i = 0; i < items.size(); ++i) {
      if (i) r += ", ";
      r += Render(g, items[i], path);
    }
    return r;
  };
  auto dict = [&](std::span<const std::pair<NodeId, NodeId>> items) {
    std::string r = "{";
    for (size_t i = 0; i < items.size(); ++i) {
      if (i) r += ", ";
      r += Render(g, items[i].first, path) + ": " + Render(g, items[i].second, path);
    }
    return r + "}";
  };
  switch (g.kind(id)) {
    case Kind::kNone: s = "None"; break;
    case Kind::kBool: s = g.bool_value(id) ? "True" : "False"; break;
    case Kind::kInt: s = std::to_string(g.int_value(id)); break;
    case Kind::kBigInt: s = "big:" + Hex(g.text(id)); break;
    case Kind::kFloat: s = ShortestDouble(g.float_value(id)); break;
    case Kind::kString: s = Quote(g.text(id), false); break;
    case Kind::kBytes: s = Quote(g.text(id), true); break;
    case Kind::kTuple:
      s = "(" + list(g.items(id)) + (g.items(id).size() == 1 ? ",)" : ")");
      break;
    case Kind::kList: s = "[" + list(g.items(id)) + "]"; break;
    case Kind::kSet: s = "set{" + list(g.items(id)) + "}"; break;
    case Kind::kDict:
      s = (g.ordered(id) ? "OrderedDict" : "") + dict(g.dict_items(id));
      if (g.state(id) != kNoNode) s += " state=" + Render(g, g.state(id), path);
      break;
    case Kind::kGlobal: s = std::string(g.module(id)) + "." + std::string(g.name(id)); break;
    case Kind::kObject: {
      const ObjectInfo o = g.object(id);
      s = "Obj(" + Render(g, o.callable, path);
      if (o.newobj) s += " new";
      if (o.args != kNoNode) s += " args=" + Render(g, o.args, path);
      if (o.kwargs != kNoNode) s += " kwargs=" + Render(g, o.kwargs, path);
      if (o.state != kNoNode) s += " state=" + Render(g, o.state, path);
      if (!o.list_items.empty()) s += " list=[" + list(o.list_items) + "]";
      if (!o.dict_items.empty()) s += " dict=" + dict(o.dict_items);
      s += ")";
      break;
    }
    case Kind::kPersistentId: s = "Pid(" + Render(g, g.persistent_id(id), path) + ")"; break;
    case Kind::kStorage: {
      const StorageInfo st = g.storage(id);
      s = "Storage(" + std::string(st.key) + " " + std::string(st.location) + " " +
          std::string(st.untyped ? "untyped" : TorchName(st.dtype)) + " " +
          std::to_string(st.numel) + ")";
      break;
    }
    case Kind::kTensor: {
      const TensorInfo t = g.tensor(id);
      s = "Tensor(" + std::string(TorchName(t.dtype)) + " off=" +
          std::to_string(t.storage_offset) + " shape=[";
      for (size_t i = 0; i < t.shape.size(); ++i) {
        s += (i ? "," : "") + std::to_string(t.shape[i]);
      }
      s += "] stride=[";
      for (size_t i = 0; i < t.stride.size(); ++i) {
        s += (i ? "," : "") + std::to_string(t.stride[i]);
      }
      s += "]";
      if (t.requires_grad) s += " rg";
      if (t.is_parameter) s += " param";
      s += " " + Render(g, t.storage, path) + ")";
      break;
    }
  }
  path.pop_back();
  return s;
}

std::string Render(const PickleGraph& g, NodeId id) {
  std::vector<NodeId> path;
  return Render(g, id, path);
}
std::string Render(const PickleGraph& g) { return Render(g, g.root()); }

// The value under string key `key` of a dict node, by id.
NodeId Get(const PickleGraph& g, NodeId dict, std::string_view key) {
  return g.DictGet(dict, key);
}

std::string ParseAndRender(const Asm& a) {
  auto r = Parse(a);
  if (!r.ok()) return "error: " + r.status().ToString();
  WalkChecked(*r);
  return Render(*r);
}

void ExpectError(const Result<PickleGraph>& r, StatusCode code, std::string_view needle = {}) {
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), code) << r.status().ToString();
  EXPECT_NE(r.status().message().find("test.pkl: pickle offset "), std::string::npos)
      << r.status().message();
  if (!needle.empty()) {
    EXPECT_NE(r.status().message().find(needle), std::string::npos) << r.status().message();
  }
}

std::filesystem::path DataDir() {
  if (const char* env = std::getenv("UCPFS_TEST_DATA"); env != nullptr && *env != '\0') {
    return env;
  }
  // Running the binary by hand: fall back to the source tree next to this file.
  return std::filesystem::path(__FILE__).parent_path().parent_path() / "data";
}

std::vector<uint8_t> ReadFile(const std::filesystem::path& p) {
  std::ifstream f(p, std::ios::binary);
  EXPECT_TRUE(f.good()) << "cannot open " << p;
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(f), {});
}

std::vector<uint8_t> ReadPickle(std::string_view name) {
  return ReadFile(DataDir() / "pickles" / name);
}

// ---------------------------------------------------------------------------------------------
// Opcode families, hand-assembled.

TEST(PickleOpcodes, Scalars) {
  EXPECT_EQ(ParseAndRender(Asm().Proto(2).None().Stop()), "None");
  EXPECT_EQ(ParseAndRender(Asm().Proto(2).True().Stop()), "True");
  EXPECT_EQ(ParseAndRender(Asm().Proto(2).False().Stop()), "False");
  EXPECT_EQ(ParseAndRender(Asm().Op('K').LE(200, 1).Stop()), "200");
  EXPECT_EQ(ParseAndRender(Asm().Op('M').LE(65535, 2).Stop()), "65535");
  EXPECT_EQ(ParseAndRender(Asm().Op('J').LE(0xFFFFFFFE, 4).Stop()), "-2");
  EXPECT_EQ(ParseAndRender(Asm().Op('J').LE(0x80000000, 4).Stop()), "-2147483648");
  EXPECT_EQ(ParseAndRender(Asm().BinFloat(-1.25).Stop()), "-1.25");
  EXPECT_EQ(ParseAndRender(Asm().BinFloat(1e300).Stop()), "1e+300");
}

TEST(PickleOpcodes, Long1AndLong4) {
  EXPECT_EQ(ParseAndRender(Asm().Op(0x8a).LE(0, 1).Stop()), "0");
  EXPECT_EQ(ParseAndRender(Asm().Op(0x8a).LE(2, 1).LE(0x00FF, 2).Stop()), "255");
  EXPECT_EQ(ParseAndRender(Asm().Op(0x8a).LE(1, 1).LE(0x80, 1).Stop()), "-128");
  // int64 bounds in exactly 8 bytes, and in 9 bytes with a redundant sign byte.
  EXPECT_EQ(ParseAndRender(Asm().Op(0x8a).LE(8, 1).LE(0x8000000000000000ull, 8).Stop()),
            "-9223372036854775808");
  EXPECT_EQ(
      ParseAndRender(Asm().Op(0x8a).LE(9, 1).LE(0x7FFFFFFFFFFFFFFFull, 8).LE(0, 1).Stop()),
      "9223372036854775807");
  EXPECT_EQ(ParseAndRender(Asm().Op(0x8a).LE(9, 1).LE(0x8000000000000000ull, 8).LE(0, 1).Stop()),
            "big:000000000000008000");  // 2**63
  EXPECT_EQ(ParseAndRender(Asm().Op(0x8b).LE(3, 4).LE(0xFFFFFF, 3).Stop()), "-1");
  EXPECT_EQ(ParseAndRender(Asm().Op(0x8b).LE(10, 4).LE(0, 8).LE(0x0100, 2).Stop()),
            "big:00000000000000000001");  // 2**72
}

TEST(PickleOpcodes, Protocol0TextScalars) {
  EXPECT_EQ(ParseAndRender(Asm().Op('I').Line("01").Stop()), "True");
  EXPECT_EQ(ParseAndRender(Asm().Op('I').Line("00").Stop()), "False");
  EXPECT_EQ(ParseAndRender(Asm().Op('I').Line("-42").Stop()), "-42");
  EXPECT_EQ(ParseAndRender(Asm().Op('I').Line("0").Stop()), "0");
  EXPECT_EQ(ParseAndRender(Asm().Op('L').Line("123L").Stop()), "123");
  EXPECT_EQ(ParseAndRender(Asm().Op('L').Line("-9223372036854775808L").Stop()),
            "-9223372036854775808");
  EXPECT_EQ(ParseAndRender(Asm().Op('L').Line("9223372036854775808").Stop()),
            "big:000000000000008000");
  EXPECT_EQ(ParseAndRender(Asm().Op('L').Line("-9223372036854775809L").Stop()),
            "big:ffffffffffffff7fff");
  EXPECT_EQ(ParseAndRender(Asm().Op('L').Line("1180591620717411303424L").Stop()),
            "big:000000000000000040");  // 2**70
  EXPECT_EQ(ParseAndRender(Asm().Op('L').Line("-36893488147419103232L").Stop()),
            "big:0000000000000000fe");  // -2**65
  EXPECT_EQ(ParseAndRender(Asm().Op('L').Line("123456789012345678901234567890L").Stop()),
            "big:d20a3f4eeee073c3f60fe98e01");
  EXPECT_EQ(ParseAndRender(Asm().Op('L').Line("-123456789012345678901234567890L").Stop()),
            "big:2ef5c0b1111f8c3c09f01671fe");
  {
    // CPython's limit is 4300 digits; exactly that many still parse.
    auto r = Parse(Asm().Op('L').Line(std::string(4300, '9') + "L").Stop());
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_EQ(r->kind(r->root()), Kind::kBigInt);
    EXPECT_EQ(r->text(r->root()).size(), 1786u);
  }
  EXPECT_EQ(ParseAndRender(Asm().Op('F').Line("1.5").Stop()), "1.5");
  EXPECT_EQ(ParseAndRender(Asm().Op('F').Line("-1e+300").Stop()), "-1e+300");
  EXPECT_EQ(ParseAndRender(Asm().Op('F').Line("inf").Stop()), "inf");
  EXPECT_EQ(ParseAndRender(Asm().Op('S').Line("'a\\x41\\n\\'q\\101'").Stop()), "'aA\\x0a\\'qA'");
  EXPECT_EQ(ParseAndRender(Asm().Op('S').Line("\"dq\"").Stop()), "'dq'");
  // raw-unicode-escape: latin-1 bytes and \u / \U escapes become UTF-8.
  EXPECT_EQ(ParseAndRender(Asm().Op('V').Line("caf\xe9 \\u2713 \\U0001f600 \\u005c").Stop()),
            "'caf\xc3\xa9 \xe2\x9c\x93 \xf0\x9f\x98\x80 \\\\'");
  EXPECT_EQ(ParseAndRender(Asm().Op('V').Line("a\\\\u0041").Stop()), "'a\\\\\\\\u0041'");
}

TEST(PickleOpcodes, StringsAndBytes) {
  EXPECT_EQ(ParseAndRender(Asm().Str("h\xc3\xa9").Stop()), "'h\xc3\xa9'");
  EXPECT_EQ(ParseAndRender(Asm().ShortStr("s").Stop()), "'s'");
  EXPECT_EQ(ParseAndRender(Asm().Op(0x8d).LE(2, 8).Raw("u8").Stop()), "'u8'");
  EXPECT_EQ(ParseAndRender(Asm().Op('T').LE(2, 4).Raw("bs").Stop()), "'bs'");
  EXPECT_EQ(ParseAndRender(Asm().Op('U').LE(3, 1).Raw("sbs").Stop()), "'sbs'");
  EXPECT_EQ(ParseAndRender(Asm().Bytes(std::string("\x00\xff", 2)).Stop()), "b'\\x00\\xff'");
  EXPECT_EQ(ParseAndRender(Asm().Op('C').LE(1, 1).Raw("c").Stop()), "b'c'");
  EXPECT_EQ(ParseAndRender(Asm().Op(0x8e).LE(2, 8).Raw("b8").Stop()), "b'b8'");
  EXPECT_EQ(ParseAndRender(Asm().Op(0x96).LE(2, 8).Raw("ba").Stop()), "b'ba'");
  EXPECT_EQ(ParseAndRender(Asm().Str("").Stop()), "''");
}

TEST(PickleOpcodes, Tuples) {
  EXPECT_EQ(ParseAndRender(Asm().EmptyTuple().Stop()), "()");
  EXPECT_EQ(ParseAndRender(Asm().Int(1).Tuple1().Stop()), "(1,)");
  EXPECT_EQ(ParseAndRender(Asm().Int(1).Int(2).Tuple2().Stop()), "(1, 2)");
  EXPECT_EQ(ParseAndRender(Asm().Int(1).Int(2).Int(3).Tuple3().Stop()), "(1, 2, 3)");
  EXPECT_EQ(ParseAndRender(Asm().Mark().Int(1).Int(2).Int(3).Int(4).Tuple().Stop()),
            "(1, 2, 3, 4)");
  EXPECT_EQ(ParseAndRender(Asm().Mark().Tuple().Stop()), "()");
}

TEST(PickleOpcodes, Lists) {
  EXPECT_EQ(ParseAndRender(Asm().EmptyList().Int(1).Append().Stop()), "[1]");
  EXPECT_EQ(ParseAndRender(Asm().EmptyList().Mark().Int(1).Int(2).Appends().Stop()), "[1, 2]");
  EXPECT_EQ(ParseAndRender(Asm().EmptyList().Mark().Appends().Stop()), "[]");
  EXPECT_EQ(ParseAndRender(Asm().Mark().Int(5).Int(6).Op('l').Stop()), "[5, 6]");
}

TEST(PickleOpcodes, Dicts) {
  EXPECT_EQ(ParseAndRender(Asm().EmptyDict().Str("a").Int(1).SetItem().Stop()), "{'a': 1}");
  EXPECT_EQ(ParseAndRender(
                Asm().EmptyDict().Mark().Str("a").Int(1).Int(2).Str("b").SetItems().Stop()),
            "{'a': 1, 2: 'b'}");
  EXPECT_EQ(ParseAndRender(Asm().Mark().Str("k").None().Op('d').Stop()), "{'k': None}");
  // Object keys are kept as (key, value) pairs.
  EXPECT_EQ(ParseAndRender(Asm().EmptyDict().Int(1).Int(2).Tuple2().Str("v").SetItem().Stop()),
            "{(1, 2): 'v'}");
}

TEST(PickleOpcodes, Sets) {
  EXPECT_EQ(ParseAndRender(Asm().Op(0x8f).Mark().Int(1).Int(2).Op(0x90).Stop()), "set{1, 2}");
  EXPECT_EQ(ParseAndRender(Asm().Mark().Int(3).Op(0x91).Stop()), "set{3}");
  EXPECT_EQ(ParseAndRender(Asm().Global("__builtin__", "set").EmptyList().Mark().Int(1).Appends()
                               .Tuple1().Reduce().Stop()),
            "set{1}");
  EXPECT_EQ(ParseAndRender(Asm().Global("builtins", "frozenset").EmptyTuple().Reduce().Stop()),
            "set{}");
}

TEST(PickleOpcodes, StackManipulation) {
  EXPECT_EQ(ParseAndRender(Asm().Int(1).Int(2).Op('0').Stop()), "1");               // POP
  EXPECT_EQ(ParseAndRender(Asm().Int(1).Mark().Int(2).Int(3).Op('1').Stop()), "1");  // POP_MARK
  EXPECT_EQ(ParseAndRender(Asm().EmptyList().Op('2').Append().Stop()), "[<cycle>]");   // DUP
  // POP with nothing above the newest MARK discards the MARK.
  EXPECT_EQ(ParseAndRender(Asm().Int(7).Mark().Op('0').Int(8).Tuple2().Stop()), "(7, 8)");
  // Frames are skipped; the opcodes inside are parsed as usual.
  EXPECT_EQ(ParseAndRender(Asm().Proto(4).Frame(3).Int(9).Stop()), "9");
  // Trailing bytes after STOP are ignored.
  EXPECT_EQ(ParseAndRender(Asm().Int(1).Stop().Raw("garbage")), "1");
  // STOP takes the top of the stack; values below are dropped.
  EXPECT_EQ(ParseAndRender(Asm().Int(1).Int(2).Stop()), "2");
}

TEST(PickleOpcodes, MemoAliasesNodes) {
  // BINPUT/BINGET: mutation after BINGET is visible through both references.
  auto r = Parse(Asm().Proto(2).EmptyList().BinPut(0).EmptyList().BinGet(0).Append()
                     .BinGet(0).Int(5).Append().Op('0').Stop());
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(Render(*r), "[[5]]");
  ASSERT_EQ(r->items(r->root()).size(), 1u);
  // LONG_BINPUT/LONG_BINGET, text PUT/GET and MEMOIZE share one memo.
  r = Parse(Asm().Proto(4).Str("a").Op('r').LE(70000, 4).Op('p').Line("3").Memoize()
                .Op('j').LE(70000, 4).Op('g').Line("3").BinGet(2).Tuple3().Stop());
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  // MEMOIZE stored index len(memo) == 2 (entries 70000 and 3 existed).
  const auto t = r->items(r->root());
  ASSERT_EQ(t.size(), 3u);
  EXPECT_EQ(t[0], t[1]);
  EXPECT_EQ(t[1], t[2]);
}

TEST(PickleOpcodes, MemoizeIndexIsEntryCount) {
  auto r = Parse(Asm().Proto(4).Int(10).Memoize().Int(11).Memoize().Int(12).Memoize()
                     .Op('0').Op('0').Op('0').BinGet(0).BinGet(1).BinGet(2).Tuple3().Stop());
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(Render(*r), "(10, 11, 12)");
  // Overwriting an index does not change the count.
  r = Parse(Asm().Proto(4).Int(1).BinPut(0).Int(2).BinPut(0).Int(3).Memoize().Op('0').Op('0')
                .Op('0').BinGet(0).BinGet(1).Tuple2().Stop());
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(Render(*r), "(2, 3)");
}

TEST(PickleOpcodes, SparseMemoIndexDoesNotAllocate) {
  PickleLimits limits;
  limits.max_memo = 1ull << 40;
  auto r = Parse(Asm().Str("x").Op('r').LE(0xFFFFFFFFu, 4).Op('0').Op('j').LE(0xFFFFFFFFu, 4)
                     .Stop(),
                 limits);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(Render(*r), "'x'");
  // A dense entry later below a sparse one still resolves.
  r = Parse(Asm().Str("a").Op('r').LE(5000, 4).Str("b").BinPut(1).Op('j').LE(5000, 4)
                .BinGet(1).Tuple2().Stop(),
            limits);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(Render(*r), "('a', 'b')");
}

TEST(PickleOpcodes, Cycles) {
  // l = [1]; l.append(l)
  auto r = Parse(Asm().Proto(2).EmptyList().BinPut(0).Mark().Int(1).BinGet(0).Appends().Stop());
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  const auto l = r->items(r->root());
  ASSERT_EQ(l.size(), 2u);
  EXPECT_EQ(l[1], r->root());
  EXPECT_EQ(WalkChecked(*r), 2u);
  // d = {}; d['self'] = d
  r = Parse(Asm().EmptyDict().BinPut(0).Str("self").BinGet(0).SetItem().Stop());
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_EQ(r->dict_items(r->root()).size(), 1u);
  EXPECT_EQ(r->dict_items(r->root())[0].second, r->root());
}

// Containers grow after creation, interleaved with building other values (APPEND/SETITEMS
// batches, memo aliases): every container keeps exactly its own items, in order.
TEST(PickleOpcodes, InterleavedGrowth) {
  // Two lists, a dict, a set and an object (list and dict items), appended to in turn, one
  // value at a time and in batches, with new containers made in between.
  Asm a;
  a.Proto(4).EmptyList().BinPut(0).EmptyList().BinPut(1).EmptyDict().BinPut(2).Op(0x8f)
      .BinPut(3).Global("m", "C").EmptyTuple().NewObj().BinPut(4);
  std::vector<int64_t> l0, l1, set, obj_list;
  std::vector<std::pair<int64_t, int64_t>> dict, obj_dict;
  for (int i = 0; i < 300; ++i) {
    a.BinGet(0).Int(i).Append();
    l0.push_back(i);
    a.BinGet(1).Mark();
    for (int k = 0; k < i % 5; ++k) {
      a.Int(1000 + i * 5 + k);
      l1.push_back(1000 + i * 5 + k);
    }
    a.Appends();
    a.EmptyList().Int(i).Append().Op('0');  // a fresh container in between
    a.BinGet(2).Mark().Int(i).Int(-i).SetItems();
    dict.emplace_back(i, -i);
    a.BinGet(3).Mark().Int(i * 7).Op(0x90);
    set.push_back(i * 7);
    a.BinGet(4).Int(i + 5000).Append().Int(i).Int(i * 2).SetItem();
    obj_list.push_back(i + 5000);
    obj_dict.emplace_back(i, i * 2);
    a.Op('0').Op('0').Op('0').Op('0').Op('0');  // the five targets
  }
  a.Mark().BinGet(0).BinGet(1).BinGet(2).BinGet(3).BinGet(4).Tuple().Stop();
  auto r = Parse(a);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  WalkChecked(*r);
  const PickleGraph& g = *r;
  const auto top = g.items(g.root());
  ASSERT_EQ(top.size(), 5u);
  auto ints = [&](std::span<const NodeId> ids) {
    std::vector<int64_t> out;
    for (NodeId id : ids) out.push_back(g.int_value(id));
    return out;
  };
  auto pairs = [&](std::span<const std::pair<NodeId, NodeId>> kv) {
    std::vector<std::pair<int64_t, int64_t>> out;
    for (const auto& [k, v] : kv) out.emplace_back(g.int_value(k), g.int_value(v));
    return out;
  };
  EXPECT_EQ(ints(g.items(top[0])), l0);
  EXPECT_EQ(ints(g.items(top[1])), l1);
  EXPECT_EQ(pairs(g.dict_items(top[2])), dict);
  EXPECT_EQ(ints(g.items(top[3])), set);
  const ObjectInfo o = g.object(top[4]);
  EXPECT_EQ(ints(o.list_items), obj_list);
  EXPECT_EQ(pairs(o.dict_items), obj_dict);
  EXPECT_TRUE(o.newobj);
  // Moving between pools costs O(items) in all: the graph holds a few times its items at most.
  EXPECT_LT(g.MemoryBytes(), 64 * g.size() + 16 * (l0.size() + l1.size() + set.size()) +
                                 32 * dict.size() + 8192);
}

// The accessors answer for any node and return empty values for other kinds.
TEST(PickleOpcodes, AccessorsOfOtherKinds) {
  auto r = Parse(Asm().Proto(2).Mark().Int(7).Str("s").EmptyDict().None().Tuple().Stop());
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  const PickleGraph& g = *r;
  const auto items = g.items(g.root());
  ASSERT_EQ(items.size(), 4u);
  for (NodeId id : {items[0], items[1], items[2], items[3], g.root(), kNoNode}) {
    SCOPED_TRACE(id);
    const bool is_int = id == items[0], is_str = id == items[1], is_dict = id == items[2];
    EXPECT_EQ(g.int_value(id), is_int ? 7 : 0);
    EXPECT_EQ(g.text(id), is_str ? "s" : "");
    EXPECT_FALSE(g.bool_value(id));
    EXPECT_EQ(g.float_value(id), 0.0);
    EXPECT_EQ(g.module(id), "");
    EXPECT_EQ(g.name(id), "");
    EXPECT_EQ(g.items(id).size(), id == g.root() ? 4u : 0u);
    EXPECT_TRUE(g.dict_items(id).empty());
    EXPECT_FALSE(g.ordered(id));
    EXPECT_EQ(g.state(id), kNoNode);
    EXPECT_EQ(g.persistent_id(id), kNoNode);
    EXPECT_EQ(g.object(id).callable, kNoNode);
    EXPECT_EQ(g.object(id).args, kNoNode);
    EXPECT_TRUE(g.storage(id).key.empty());
    EXPECT_EQ(g.tensor(id).storage, kNoNode);
    EXPECT_TRUE(g.tensor(id).shape.empty());
    EXPECT_EQ(g.DictGet(id, "k"), kNoNode);
    EXPECT_EQ(g.ClassName(id), "");
    EXPECT_FALSE(g.IsGlobal(id, "", ""));
    if (is_dict) {
      EXPECT_EQ(g.kind(id), Kind::kDict);
    }
  }
}

TEST(PickleOpcodes, GlobalsAndPython2Names) {
  EXPECT_EQ(ParseAndRender(Asm().Global("__builtin__", "object").Stop()), "builtins.object");
  EXPECT_EQ(ParseAndRender(Asm().Global("copy_reg", "_reconstructor").Stop()),
            "copyreg._reconstructor");
  EXPECT_EQ(ParseAndRender(Asm().Global("__builtin__", "unicode").Stop()), "builtins.str");
  EXPECT_EQ(ParseAndRender(Asm().Global("__builtin__", "xrange").Stop()), "builtins.range");
  EXPECT_EQ(ParseAndRender(Asm().Global("torch", "float32").Stop()), "torch.float32");
  EXPECT_EQ(ParseAndRender(Asm().Proto(4).StackGlobal("pathlib", "PosixPath").Stop()),
            "pathlib.PosixPath");
  EXPECT_EQ(ParseAndRender(Asm().Proto(4).StackGlobal("__builtin__", "set").Stop()),
            "builtins.set");
}

TEST(PickleOpcodes, GenericObjects) {
  // REDUCE of an unknown callable.
  EXPECT_EQ(ParseAndRender(Asm().Global("pathlib", "PosixPath").Str("/").Str("a").Tuple2()
                               .Reduce().Stop()),
            "Obj(pathlib.PosixPath args=('/', 'a'))");
  // NEWOBJ + BUILD with dict state.
  EXPECT_EQ(ParseAndRender(Asm().Proto(2).Global("argparse", "Namespace").EmptyTuple().NewObj()
                               .EmptyDict().Str("lr").BinFloat(0.5).SetItem().Build().Stop()),
            "Obj(argparse.Namespace new args=() state={'lr': 0.5})");
  // BUILD with (dict, slotstate) and with tuple state.
  EXPECT_EQ(ParseAndRender(Asm().Proto(2).Global("m", "C").EmptyTuple().NewObj().None()
                               .EmptyDict().Str("s").Int(1).SetItem().Tuple2().Build().Stop()),
            "Obj(m.C new args=() state=(None, {'s': 1}))");
  EXPECT_EQ(ParseAndRender(Asm().Proto(2).Global("m", "TensorProperties").EmptyTuple().NewObj()
                               .Global("torch", "float32").False().Tuple2().Build().Stop()),
            "Obj(m.TensorProperties new args=() state=(torch.float32, False))");
  // NEWOBJ_EX keeps kwargs.
  EXPECT_EQ(ParseAndRender(Asm().Proto(4).StackGlobal("m", "K").Int(1).Tuple1().EmptyDict()
                               .Str("k").Int(2).SetItem().Op(0x92).Stop()),
            "Obj(m.K new args=(1,) kwargs={'k': 2})");
  // SETITEM(S)/APPEND(S) on objects (defaultdict, list subclasses).
  EXPECT_EQ(ParseAndRender(Asm().Proto(2).Global("collections", "defaultdict")
                               .Global("__builtin__", "list").Tuple1().Reduce()
                               .Mark().Str("a").Int(1).SetItems().Str("b").Int(2).SetItem()
                               .Stop()),
            "Obj(collections.defaultdict args=(builtins.list,) dict={'a': 1, 'b': 2})");
  EXPECT_EQ(ParseAndRender(Asm().Proto(2).Global("m", "MyList").EmptyTuple().NewObj()
                               .Mark().Int(1).Int(2).Appends().Int(3).Append().Stop()),
            "Obj(m.MyList new args=() list=[1, 2, 3])");
  // Enums, both ways.
  EXPECT_EQ(ParseAndRender(Asm().Proto(4).StackGlobal("builtins", "getattr")
                               .StackGlobal("m", "Color").ShortStr("RED").Tuple2().Reduce()
                               .Stop()),
            "Obj(builtins.getattr args=(m.Color, 'RED'))");
  EXPECT_EQ(ParseAndRender(Asm().Proto(2).Global("m", "Color").Int(1).Tuple1().Reduce().Stop()),
            "Obj(m.Color args=(1,))");
  // INST and OBJ (protocol 0/1 instances).
  EXPECT_EQ(ParseAndRender(Asm().Mark().Int(1).Op('i').Line("m").Line("Old").Stop()),
            "Obj(m.Old args=(1,))");
  EXPECT_EQ(ParseAndRender(Asm().Mark().Global("m", "Old").Int(2).Op('o').Stop()),
            "Obj(m.Old args=(2,))");
  // copyreg._reconstructor(cls, object, None) names the class.
  auto r = Parse(Asm().Global("copy_reg", "_reconstructor").Global("argparse", "Namespace")
                     .Global("__builtin__", "object").None().Tuple3().Reduce().Stop());
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->ClassName(r->root()), "Namespace");
  // PERSID and a BINPERSID that is not a torch storage.
  EXPECT_EQ(ParseAndRender(Asm().Op('P').Line("pid-1").Stop()), "Pid('pid-1')");
  EXPECT_EQ(ParseAndRender(Asm().Str("thing").Int(3).Tuple2().Op('Q').Stop()),
            "Pid(('thing', 3))");
}

// IntEnumValue reads an int Enum in both pickled forms, and nothing else: the exact bytes
// Debian 12's Python 3.11.2 writes for DeepSpeed's ZeroStageEnum.optimizer_states (by name,
// protocol 2, Python 2 module name for getattr), and those of later Pythons (by value).
TEST(PickleOpcodes, IntEnumValueBothForms) {
  static constexpr IntEnumMember kMembers[] = {{"disabled", 0}, {"optimizer_states", 1}, {"gradients", 2},
                                               {"weights", 3}, {"max_stage", 3}};
  const IntEnumType zero_stage = {"deepspeed.runtime.zero.config", "ZeroStageEnum", kMembers};
  auto value = [&](const Asm& a) -> std::optional<int64_t> {
    auto r = Parse(a);
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    if (!r.ok()) return std::nullopt;
    return IntEnumValue(*r, r->root(), zero_stage);
  };
  const auto by_name = [](std::string_view module, std::string_view cls, std::string_view member) {
    return Asm().Proto(2).Global("__builtin__", "getattr").BinPut(0).Global(module, cls).BinPut(1)
        .Str(member).BinPut(2).Tuple2().BinPut(3).Reduce().BinPut(4).Stop();
  };
  EXPECT_EQ(value(by_name("deepspeed.runtime.zero.config", "ZeroStageEnum", "optimizer_states")), 1);
  EXPECT_EQ(value(by_name("deepspeed.runtime.zero.config", "ZeroStageEnum", "weights")), 3);
  EXPECT_EQ(value(by_name("deepspeed.runtime.zero.config", "ZeroStageEnum", "max_stage")), 3);
  EXPECT_EQ(value(Asm().Proto(2).Global("deepspeed.runtime.zero.config", "ZeroStageEnum").Int(2).Tuple1()
                      .Reduce().Stop()), 2);
  // Not a member, another class, another callable, extra arguments or state: no value.
  EXPECT_EQ(value(by_name("deepspeed.runtime.zero.config", "ZeroStageEnum", "__class__")), std::nullopt);
  EXPECT_EQ(value(by_name("deepspeed.runtime.zero.config", "OtherEnum", "gradients")), std::nullopt);
  EXPECT_EQ(value(by_name("os", "ZeroStageEnum", "gradients")), std::nullopt);
  EXPECT_EQ(value(Asm().Proto(2).Global("deepspeed.runtime.zero.config", "ZeroStageEnum").Int(7).Tuple1()
                      .Reduce().Stop()), std::nullopt);
  EXPECT_EQ(value(Asm().Proto(2).Global("builtins", "setattr").Global("deepspeed.runtime.zero.config", "ZeroStageEnum")
                      .Str("gradients").Tuple2().Reduce().Stop()), std::nullopt);
  EXPECT_EQ(value(Asm().Proto(2).Global("deepspeed.runtime.zero.config", "ZeroStageEnum").Int(1).Int(2).Tuple2()
                      .Reduce().Stop()), std::nullopt);
  EXPECT_EQ(value(Asm().Proto(2).Global("deepspeed.runtime.zero.config", "ZeroStageEnum").Int(1).Tuple1()
                      .Reduce().EmptyDict().Build().Stop()), std::nullopt);
  EXPECT_EQ(value(Asm().Int(1).Stop()), std::nullopt);
}

TEST(PickleOpcodes, DictGetLastWins) {
  auto r = Parse(Asm().EmptyDict().Mark().Str("k").Int(1).Int(5).Int(6).Str("k").Int(2)
                     .SetItems().Stop());
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_NE(r->DictGet(r->root(), "k"), kNoNode);
  EXPECT_EQ(r->int_value(r->DictGet(r->root(), "k")), 2);
  EXPECT_EQ(r->DictGet(r->root(), "5"), kNoNode);
  EXPECT_EQ(r->DictGet(kNoNode, "k"), kNoNode);
  EXPECT_FALSE(r->IsGlobal(kNoNode, "m", "n"));
  EXPECT_EQ(r->ClassName(r->root()), "");
}

TEST(PickleOpcodes, BuildOnDictSetsState) {
  auto r = Parse(Asm().Proto(2).Global("collections", "OrderedDict").EmptyTuple().Reduce()
                     .Mark().Str("b").Int(1).Str("a").Int(2).SetItems()
                     .EmptyDict().Str("_metadata").EmptyDict().SetItem().Build().Stop());
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(Render(*r), "OrderedDict{'b': 1, 'a': 2} state={'_metadata': {}}");
  EXPECT_TRUE(r->ordered(r->root()));
  EXPECT_NE(r->DictGet(r->root(), "b"), kNoNode);
  EXPECT_EQ(r->DictGet(r->root(), "c"), kNoNode);
  ASSERT_NE(r->DictGet(r->state(r->root()), "_metadata"), kNoNode);
  EXPECT_EQ(r->kind(r->DictGet(r->state(r->root()), "_metadata")), Kind::kDict);
}

TEST(PickleOpcodes, Whitelist) {
  // OrderedDict via NEWOBJ and the old list-of-pairs form.
  EXPECT_EQ(ParseAndRender(Asm().Proto(2).Global("collections", "OrderedDict").EmptyTuple()
                               .NewObj().Stop()),
            "OrderedDict{}");
  EXPECT_EQ(ParseAndRender(Asm().Global("collections", "OrderedDict").EmptyList().Mark()
                               .Str("x").Int(1).Tuple2().Appends().Tuple1().Reduce().Stop()),
            "OrderedDict{'x': 1}");
  // torch.Size(tuple) is the tuple itself.
  EXPECT_EQ(ParseAndRender(Asm().Global("torch", "Size").IntTuple({4, 3}).Tuple1().Reduce()
                               .Stop()),
            "(4, 3)");
  // _codecs.encode(str, 'latin1') and bytearray/bytes.
  EXPECT_EQ(ParseAndRender(Asm().Global("_codecs", "encode").Str("\xc3\xbf" "a").Str("latin1")
                               .Tuple2().Reduce().Stop()),
            "b'\\xffa'");
  EXPECT_EQ(ParseAndRender(Asm().Global("_codecs", "encode").Str("\xe2\x9c\x93").Str("utf-8")
                               .Tuple2().Reduce().Stop()),
            "b'\\xe2\\x9c\\x93'");
  // A code point above 0xff cannot be latin-1: stays a generic object.
  EXPECT_EQ(ParseAndRender(Asm().Global("_codecs", "encode").Str("\xe2\x9c\x93").Str("latin1")
                               .Tuple2().Reduce().Stop()),
            "Obj(_codecs.encode args=('\xe2\x9c\x93', 'latin1'))");
  EXPECT_EQ(ParseAndRender(Asm().Global("__builtin__", "bytearray").Bytes("ab").Tuple1()
                               .Reduce().Stop()),
            "b'ab'");
  EXPECT_EQ(ParseAndRender(Asm().Global("__builtin__", "bytearray").Str("\xc2\x80").Str("latin-1")
                               .Tuple2().Reduce().Stop()),
            "b'\\x80'");
  EXPECT_EQ(ParseAndRender(Asm().Global("__builtin__", "bytes").EmptyTuple().Reduce().Stop()),
            "b''");
  // Wrong shapes fall back to generic objects.
  EXPECT_EQ(ParseAndRender(Asm().Global("torch", "Size").Int(3).Tuple1().Reduce().Stop()),
            "Obj(torch.Size args=(3,))");
  EXPECT_EQ(ParseAndRender(Asm().Global("builtins", "set").Int(3).Tuple1().Reduce().Stop()),
            "Obj(builtins.set args=(3,))");
}

// ---- torch interpretation ----

Asm& RebuildV2(Asm& a, std::string_view cls, int64_t numel, int64_t offset,
               std::initializer_list<int64_t> size, std::initializer_list<int64_t> stride,
               bool rg = false) {
  a.Global("torch._utils", "_rebuild_tensor_v2").Mark().StoragePid("torch", cls, "0", numel)
      .Int(offset).IntTuple(size).IntTuple(stride);
  if (rg) {
    a.True();
  } else {
    a.False();
  }
  return a.Global("collections", "OrderedDict").EmptyTuple().Reduce().Tuple().Reduce();
}

TEST(PickleTorch, RebuildTensorV2) {
  Asm a;
  a.Proto(2);
  RebuildV2(a, "FloatStorage", 12, 4, {2, 2}, {3, 1}).Stop();
  auto r = Parse(a);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_EQ(r->kind(r->root()), Kind::kTensor);
  const TensorInfo t = r->tensor(r->root());
  EXPECT_EQ(t.dtype, DType::kFloat32);
  EXPECT_EQ(t.storage_offset, 4);
  EXPECT_EQ(Vec(t.shape), (std::vector<int64_t>{2, 2}));
  EXPECT_EQ(Vec(t.stride), (std::vector<int64_t>{3, 1}));
  EXPECT_FALSE(t.requires_grad);
  EXPECT_FALSE(t.is_parameter);
  EXPECT_EQ(t.state, kNoNode);
  ASSERT_EQ(r->kind(t.storage), Kind::kStorage);
  const StorageInfo s = r->storage(t.storage);
  EXPECT_EQ(s.key, "0");
  EXPECT_EQ(s.location, "cpu");
  EXPECT_EQ(s.dtype, DType::kFloat32);
  EXPECT_FALSE(s.untyped);
  EXPECT_EQ(s.numel, 12u);

  Asm b;
  RebuildV2(b, "BFloat16Storage", 6, 0, {}, {}).Stop();  // 0-d
  EXPECT_EQ(ParseAndRender(b),
            "Tensor(bfloat16 off=0 shape=[] stride=[] Storage(0 cpu bfloat16 6))");
  Asm c;
  RebuildV2(c, "UntypedStorage", 16, 0, {16}, {1}).Stop();
  EXPECT_EQ(ParseAndRender(c),
            "Tensor(uint8 off=0 shape=[16] stride=[1] Storage(0 cpu untyped 16))");
}

TEST(PickleTorch, RebuildTensorV3AndOld) {
  Asm a;
  a.Proto(2).Global("torch._utils", "_rebuild_tensor_v3").Mark()
      .StoragePid("torch.storage", "UntypedStorage", "3", 8, "cuda:0").Int(0).IntTuple({8})
      .IntTuple({1}).False().Global("collections", "OrderedDict").EmptyTuple().Reduce()
      .Global("torch", "float8_e4m3fn").Tuple().Reduce().Stop();
  EXPECT_EQ(ParseAndRender(a),
            "Tensor(float8_e4m3fn off=0 shape=[8] stride=[1] Storage(3 cuda:0 untyped 8))");
  Asm b;
  b.Global("torch._utils", "_rebuild_tensor").Mark().StoragePid("torch", "LongStorage", "1", 5)
      .Int(1).IntTuple({4}).IntTuple({1}).Tuple().Reduce().Stop();
  EXPECT_EQ(ParseAndRender(b), "Tensor(int64 off=1 shape=[4] stride=[1] Storage(1 cpu int64 5))");
  // Unknown dtype name: generic object.
  Asm c;
  c.Global("torch._utils", "_rebuild_tensor_v3").Mark()
      .StoragePid("torch", "UntypedStorage", "0", 1)
      .Int(0).IntTuple({1}).IntTuple({1}).False().None().Global("torch", "float4_e2m1fn_x2")
      .Tuple().Reduce().Stop();
  auto r = Parse(c);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->kind(r->root()), Kind::kObject);
  EXPECT_EQ(r->ClassName(r->root()), "_rebuild_tensor_v3");
}

TEST(PickleTorch, Parameters) {
  Asm a;
  a.Proto(2).Global("torch._utils", "_rebuild_parameter");
  RebuildV2(a, "FloatStorage", 4, 0, {2, 2}, {2, 1}).True().Global("collections", "OrderedDict")
      .EmptyTuple().Reduce().Tuple3().Reduce().Stop();
  EXPECT_EQ(ParseAndRender(a),
            "Tensor(float32 off=0 shape=[2,2] stride=[2,1] rg param Storage(0 cpu float32 4))");
  Asm b;
  b.Proto(2).Global("torch._utils", "_rebuild_parameter_with_state").Mark();
  RebuildV2(b, "HalfStorage", 2, 0, {2}, {1}).False().None().EmptyDict().Tuple().Reduce().Stop();
  auto r = Parse(b);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_EQ(r->kind(r->root()), Kind::kTensor);
  EXPECT_TRUE(r->tensor(r->root()).is_parameter);
  EXPECT_EQ(r->tensor(r->root()).dtype, DType::kFloat16);
  // _rebuild_from_type_v2(func, Parameter, args, state)
  Asm c;
  c.Proto(2).Global("torch._tensor", "_rebuild_from_type_v2").Mark()
      .Global("torch._utils", "_rebuild_tensor_v2").Global("torch.nn.parameter", "Parameter")
      .Mark().StoragePid("torch", "DoubleStorage", "7", 3).Int(0).IntTuple({3}).IntTuple({1})
      .True().None().Tuple().EmptyDict().Tuple().Reduce().Stop();
  EXPECT_EQ(ParseAndRender(c),
            "Tensor(float64 off=0 shape=[3] stride=[1] rg param Storage(7 cpu float64 3))");
  // ... with a plain tensor subclass it is a tensor, not a parameter.
  Asm d;
  d.Proto(2).Global("torch._tensor", "_rebuild_from_type_v2").Mark()
      .Global("torch._utils", "_rebuild_tensor_v2").Global("torch", "Tensor")
      .Mark().StoragePid("torch", "DoubleStorage", "7", 3).Int(0).IntTuple({3}).IntTuple({1})
      .False().None().Tuple().EmptyDict().Tuple().Reduce().Stop();
  EXPECT_EQ(ParseAndRender(d),
            "Tensor(float64 off=0 shape=[3] stride=[1] Storage(7 cpu float64 3))");
}

TEST(PickleTorch, FuzzSeedTensorV3) {
  const auto data = ReadFile(DataDir().parent_path() / "fuzz" / "seeds" / "pickle_tensor_v3.bin");
  auto r = ParseBytes(data);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(Render(*r),
            "Tensor(float8_e4m3fn off=0 shape=[8] stride=[1] rg param Storage(0 cpu untyped 8))");
}

TEST(PickleTorch, WrongShapesStayGeneric) {
  // Storage argument is not a storage.
  Asm a;
  a.Global("torch._utils", "_rebuild_tensor_v2").Mark().None().Int(0).IntTuple({1})
      .IntTuple({1}).False().None().Tuple().Reduce().Stop();
  auto r = Parse(a);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->kind(r->root()), Kind::kObject);
  // Too few arguments.
  Asm b;
  b.Global("torch._utils", "_rebuild_tensor_v2").Mark().StoragePid("torch", "FloatStorage", "0", 1)
      .Int(0).Tuple().Reduce().Stop();
  r = Parse(b);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->kind(r->root()), Kind::kObject);
  // A storage pid with an unknown class name is a generic persistent id.
  EXPECT_EQ(ParseAndRender(Asm().StoragePid("torch", "QUInt4x2Storage", "0", 1).Stop()),
            "Pid(('storage', torch.QUInt4x2Storage, '0', 'cpu', 1))");
  // _rebuild_parameter of something that is not a tensor.
  EXPECT_EQ(ParseAndRender(Asm().Global("torch._utils", "_rebuild_parameter").None().False()
                               .None().Tuple3().Reduce().Stop()),
            "Obj(torch._utils._rebuild_parameter args=(None, False, None))");
}

TEST(PickleTorch, MalformedTensorArgsAreCorrupt) {
  Asm a;
  RebuildV2(a, "FloatStorage", 12, 0, {2, 2}, {1}).Stop();
  ExpectError(Parse(a), StatusCode::kCorrupt, "REDUCE: _rebuild_tensor_v2: size has 2 dims");
  Asm b;
  RebuildV2(b, "FloatStorage", 12, 0, {-2}, {1}).Stop();
  ExpectError(Parse(b), StatusCode::kCorrupt, "negative size");
  Asm c;
  RebuildV2(c, "FloatStorage", 12, -1, {2}, {1}).Stop();
  ExpectError(Parse(c), StatusCode::kCorrupt, "negative storage offset");
  Asm d;
  RebuildV2(d, "FloatStorage", 12, 0, {2}, {-1}).Stop();
  ExpectError(Parse(d), StatusCode::kCorrupt, "negative stride");
  ExpectError(Parse(Asm().StoragePid("torch", "FloatStorage", "0", -5).Stop()),
              StatusCode::kCorrupt, "BINPERSID: storage numel -5 is negative");
  // The offset in the message is the REDUCE opcode's.
  Asm e;
  RebuildV2(e, "FloatStorage", 12, 0, {2, 2}, {1}).Stop();
  auto r = Parse(e);
  ASSERT_FALSE(r.ok());
  const std::string want = "pickle offset " + std::to_string(e.size() - 2) + ": REDUCE";
  EXPECT_NE(r.status().message().find(want), std::string::npos) << r.status().message();
}

// ---------------------------------------------------------------------------------------------
// Real pickles written by CPython (make_pickles.py).

class PlainPickle : public ::testing::TestWithParam<int> {};

TEST_P(PlainPickle, ExactStructure) {
  const int proto = GetParam();
  const auto data = ReadPickle("plain_p" + std::to_string(proto) + ".pkl");
  ASSERT_FALSE(data.empty());
  auto r = ParseBytes(data);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  const PickleGraph& g = *r;
  WalkChecked(g);
  const NodeId root = g.root();
  ASSERT_EQ(g.kind(root), Kind::kDict);
  EXPECT_FALSE(g.ordered(root));
  auto R = [&](std::string_view key) {
    NodeId id = Get(g, root, key);
    return id == kNoNode ? std::string("<missing>") : Render(g, id);
  };
  std::vector<std::string> keys;
  for (const auto& [k, v] : g.dict_items(root)) keys.push_back(std::string(g.text(k)));
  EXPECT_EQ(keys, (std::vector<std::string>{
                      "none", "true", "false", "int_small", "int_neg", "int_65535", "int32_min",
                      "int_2_40", "int64_min", "big", "bigneg", "float", "float_neg", "float_big",
                      "bytes", "empty_bytes", "bytearray", "str", "str_esc", "empty_str",
                      "nested", "ns", "color", "point", "path", "od", "selfref", "rec_tuple",
                      "shared_a", "shared_b"}));
  EXPECT_EQ(R("none"), "None");
  EXPECT_EQ(R("true"), "True");
  EXPECT_EQ(R("false"), "False");
  EXPECT_EQ(g.kind(Get(g, root, "true")), Kind::kBool);
  EXPECT_EQ(R("int_small"), "7");
  EXPECT_EQ(R("int_neg"), "-300");
  EXPECT_EQ(R("int_65535"), "65535");
  EXPECT_EQ(R("int32_min"), "-2147483648");
  EXPECT_EQ(R("int_2_40"), "1099511627776");
  EXPECT_EQ(R("int64_min"), "-9223372036854775808");
  EXPECT_EQ(g.kind(Get(g, root, "int64_min")), Kind::kInt);
  EXPECT_EQ(R("big"), "big:000000000000000040");     // 2**70
  EXPECT_EQ(R("bigneg"), "big:0000000000000000fe");  // -2**65
  EXPECT_EQ(R("float"), "1.5");
  EXPECT_EQ(R("float_neg"), "-0.25");
  EXPECT_EQ(R("float_big"), "1e+300");
  EXPECT_EQ(R("bytes"), "b'\\x00\\x01\\xffabc'");
  EXPECT_EQ(R("empty_bytes"), "b''");
  EXPECT_EQ(R("bytearray"), "b'xy\\x80'");
  EXPECT_EQ(R("str"), "'h\xc3\xa9llo w\xc3\xb6rld \xe2\x9c\x93 \xf0\x9f\x98\x80'");
  EXPECT_EQ(R("str_esc"), "'back\\\\slash\\x0anew\\x0dline\\x00nul'");
  EXPECT_EQ(R("empty_str"), "''");
  EXPECT_EQ(R("nested"),
            "{'list': [1, [2, 3], (4, 5)], 'tuple': (1, 'a', (None,)), 'empty_tuple': (), "
            "'set': set{1, 2, 3}, 'frozenset': set{4, 5}, 'int_key': {1: 'one', 2: 'two'}}");

  // Objects: the class is named whatever the protocol (NEWOBJ for 2+, copyreg._reconstructor
  // for 0/1), and BUILD recorded the instance dict.
  const NodeId ns = Get(g, root, "ns");
  EXPECT_EQ(g.ClassName(ns), "Namespace");
  EXPECT_TRUE(g.IsGlobal(g.object(ns).callable, "argparse", "Namespace"));
  EXPECT_EQ(Render(g, g.object(ns).state), "{'lr': 0.1, 'name': 'run'}");
  EXPECT_EQ(g.state(ns), g.object(ns).state);
  EXPECT_EQ(g.object(ns).newobj, proto >= 2);
  const NodeId point = Get(g, root, "point");
  EXPECT_TRUE(g.IsGlobal(g.object(point).callable, "__main__", "Point"));
  EXPECT_EQ(Render(g, g.object(point).state), "{'x': 3, 'y': 2.5, 'tag': 'p'}");
  EXPECT_EQ(R("color"), "Obj(__main__.Color args=(2,))");
  const NodeId path = Get(g, root, "path");
  EXPECT_EQ(g.ClassName(path), "PurePosixPath");
  EXPECT_EQ(Render(g, g.object(path).args), "('/', 'tmp', 'ckpt', 'step-100')");
  EXPECT_EQ(R("od"), "OrderedDict{'b': 1, 'a': [2, 3]}");

  // Shared and cyclic references alias one node.
  EXPECT_EQ(Get(g, root, "shared_a"), Get(g, root, "shared_b"));
  EXPECT_EQ(R("shared_a"), "[10, 20]");
  const NodeId selfref = Get(g, root, "selfref");
  ASSERT_EQ(g.items(selfref).size(), 2u);
  EXPECT_EQ(g.items(selfref)[1], selfref);
  EXPECT_EQ(R("selfref"), "[1, <cycle>]");
  const NodeId rec = Get(g, root, "rec_tuple");
  ASSERT_EQ(g.kind(rec), Kind::kTuple);
  ASSERT_EQ(g.items(rec).size(), 2u);
  const NodeId inner = g.items(rec)[0];
  ASSERT_EQ(g.kind(inner), Kind::kList);
  ASSERT_EQ(g.items(inner).size(), 1u);
  EXPECT_EQ(g.items(inner)[0], rec);
}

INSTANTIATE_TEST_SUITE_P(Protocols, PlainPickle, ::testing::Values(0, 1, 2, 3, 4, 5));

TEST(PlainPickleAll, BigIntsAgreeAcrossProtocols) {
  // Protocol 0 writes decimal text, 2+ writes LONG1: both become the same minimal bytes.
  std::set<std::string> big;
  for (int proto : {0, 2, 5}) {
    auto r = ParseBytes(ReadPickle("plain_p" + std::to_string(proto) + ".pkl"));
    ASSERT_TRUE(r.ok());
    ASSERT_NE(r->DictGet(r->root(), "bigneg"), kNoNode);
    big.insert(std::string(r->text(r->DictGet(r->root(), "bigneg"))));
  }
  EXPECT_EQ(big.size(), 1u);
}

// ---------------------------------------------------------------------------------------------
// torch 1.13 torch.save data.pkl and DCP .metadata (make_torch_pickles.py).

TEST(PickleRealTorch, StateDict) {
  const auto data = ReadPickle("torch_state_dict.pkl");
  std::ifstream jf(DataDir() / "pickles" / "torch_state_dict.json");
  ASSERT_TRUE(jf.good());
  const nlohmann::ordered_json want = nlohmann::ordered_json::parse(jf);
  auto r = ParseBytes(data);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  const PickleGraph& g = *r;
  WalkChecked(g);
  const NodeId root = g.root();
  ASSERT_EQ(g.kind(root), Kind::kDict);
  EXPECT_TRUE(g.ordered(root));
  ASSERT_EQ(g.dict_items(root).size(), want["tensors"].size());
  size_t i = 0;
  for (const auto& [name, w] : want["tensors"].items()) {
    SCOPED_TRACE(name);
    const auto& [k, v] = g.dict_items(root)[i++];
    EXPECT_EQ(g.text(k), name);
    ASSERT_EQ(g.kind(v), Kind::kTensor);
    const TensorInfo t = g.tensor(v);
    EXPECT_EQ(TorchName(t.dtype), w["dtype"].get<std::string>());
    EXPECT_EQ(t.storage_offset, w["storage_offset"].get<int64_t>());
    EXPECT_EQ(Vec(t.shape), w["shape"].get<std::vector<int64_t>>());
    EXPECT_EQ(Vec(t.stride), w["stride"].get<std::vector<int64_t>>());
    EXPECT_EQ(t.requires_grad, w["requires_grad"].get<bool>());
    EXPECT_EQ(t.is_parameter, w["is_parameter"].get<bool>());
    ASSERT_EQ(g.kind(t.storage), Kind::kStorage);
    const StorageInfo s = g.storage(t.storage);
    EXPECT_EQ(s.key, w["storage_key"].get<std::string>());
    EXPECT_EQ(s.location, "cpu");
    EXPECT_EQ(s.numel, w["storage_numel"].get<uint64_t>());
    EXPECT_FALSE(s.untyped);
    EXPECT_EQ(s.dtype, t.dtype);
    EXPECT_EQ("torch." + std::string(StorageClassName(s.dtype)),
              w["storage_class"].get<std::string>());
  }
  // OrderedDict state from BUILD: {'_metadata': OrderedDict({'': {...}, 'sub': {...}})}.
  ASSERT_NE(g.state(root), kNoNode);
  EXPECT_EQ(Render(g, g.state(root)),
            "{'_metadata': OrderedDict{'': {'version': 1}, 'sub': {'version': 2}}}");
}

TEST(PickleRealTorch, DcpMetadata) {
  const auto data = ReadPickle("dcp113.metadata");
  auto r = ParseBytes(data);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  const PickleGraph& g = *r;
  WalkChecked(g);
  EXPECT_EQ(g.ClassName(g.root()), "Metadata");

  // Every class name in the graph, found by an iterative walk.
  std::set<std::string> classes;
  {
    std::vector<bool> seen(g.size());
    std::vector<NodeId> todo{g.root()};
    while (!todo.empty()) {
      NodeId id = todo.back();
      todo.pop_back();
      if (id == kNoNode || seen[id]) continue;
      seen[id] = true;
      if (!g.ClassName(id).empty()) classes.insert(std::string(g.ClassName(id)));
      ForEachRef(g, id, [&](NodeId ref) { todo.push_back(ref); });
    }
  }
  for (const char* c : {"Metadata", "TensorStorageMetadata", "ChunkStorageMetadata",
                        "BytesStorageMetadata", "TensorProperties", "MetadataIndex",
                        "_StorageInfo"}) {
    EXPECT_TRUE(classes.count(c)) << c;
  }

  const NodeId state = g.object(g.root()).state;
  const NodeId sdm_id = g.DictGet(state, "state_dict_metadata");
  ASSERT_NE(sdm_id, kNoNode);
  ASSERT_EQ(g.kind(sdm_id), Kind::kDict);
  std::set<std::string> keys;
  for (const auto& [k, v] : g.dict_items(sdm_id)) keys.insert(std::string(g.text(k)));
  EXPECT_EQ(keys, (std::set<std::string>{"model.w", "model.emb", "model.bias", "model.scalar",
                                         "step", "meta"}));
  // model.w: TensorStorageMetadata{properties: TensorProperties(state=(float32, ...)),
  // size: torch.Size([4, 3]), chunks: [2 x ChunkStorageMetadata]}.
  const NodeId w = Get(g, sdm_id, "model.w");
  EXPECT_EQ(g.ClassName(w), "TensorStorageMetadata");
  const NodeId w_state = g.object(w).state;
  EXPECT_EQ(Render(g, Get(g, w_state, "size")), "(4, 3)");
  const NodeId props = Get(g, w_state, "properties");
  EXPECT_EQ(g.ClassName(props), "TensorProperties");
  ASSERT_EQ(g.kind(g.object(props).state), Kind::kTuple);
  ASSERT_FALSE(g.items(g.object(props).state).empty());
  EXPECT_TRUE(g.IsGlobal(g.items(g.object(props).state)[0], "torch", "float32"));
  const NodeId chunks_id = g.DictGet(w_state, "chunks");
  ASSERT_NE(chunks_id, kNoNode);
  const auto chunks = g.items(chunks_id);
  ASSERT_EQ(chunks.size(), 2u);
  EXPECT_EQ(g.ClassName(chunks[1]), "ChunkStorageMetadata");
  EXPECT_EQ(Render(g, g.object(chunks[1]).state), "{'offsets': (2, 0), 'sizes': (2, 3)}");
  EXPECT_EQ(g.ClassName(Get(g, sdm_id, "step")), "BytesStorageMetadata");
  EXPECT_EQ(Render(g, Get(g, g.object(Get(g, sdm_id, "model.emb")).state, "size")), "(5, 2)");
  // storage_data has object keys (MetadataIndex).
  const NodeId storage = g.DictGet(state, "storage_data");
  ASSERT_NE(storage, kNoNode);
  ASSERT_FALSE(g.dict_items(storage).empty());
  EXPECT_EQ(g.ClassName(g.dict_items(storage)[0].first), "MetadataIndex");
  EXPECT_EQ(g.ClassName(g.dict_items(storage)[0].second), "_StorageInfo");
}

// ---------------------------------------------------------------------------------------------
// Corrupt and hostile inputs.

std::vector<std::vector<uint8_t>> ValidSamples() {
  std::vector<std::vector<uint8_t>> out;
  for (int p : {0, 1, 2, 3, 4, 5}) {
    out.push_back(ReadPickle("plain_p" + std::to_string(p) + ".pkl"));
  }
  out.push_back(ReadPickle("torch_state_dict.pkl"));
  out.push_back(ReadPickle("dcp113.metadata"));
  Asm b;
  b.Proto(2).Op('I').Line("12").Op('p').Line("0").Op('F').Line("2.5").Op('S').Line("'x'")
      .Op('V').Line("y").Op('g').Line("0").Mark().Op('t').Op(0x87).Op('0').Op(0x85).Stop();
  out.push_back(b.bytes());
  return out;
}

TEST(PickleCorrupt, SamplesParse) {
  for (const auto& s : ValidSamples()) {
    auto r = ParseBytes(s);
    EXPECT_TRUE(r.ok()) << r.status().ToString();
  }
}

TEST(PickleCorrupt, EveryTruncationIsCorrupt) {
  for (const auto& s : ValidSamples()) {
    ASSERT_TRUE(ParseBytes(s).ok());
    for (size_t len = 0; len < s.size(); ++len) {
      std::vector<uint8_t> prefix(s.begin(), s.begin() + static_cast<std::ptrdiff_t>(len));
      auto r = ParseBytes(prefix);
      ASSERT_FALSE(r.ok()) << "prefix " << len;
      EXPECT_EQ(r.status().code(), StatusCode::kCorrupt) << r.status().ToString();
      EXPECT_NE(r.status().message().find("test.pkl: pickle offset "), std::string::npos);
      bool ran_out = false;  // ... and is said to have run out of bytes, not to be wrong
      EXPECT_FALSE(ParsePickle({reinterpret_cast<const std::byte*>(prefix.data()), prefix.size()}, "t", {}, &ran_out).ok());
      EXPECT_TRUE(ran_out) << "prefix " << len << ": " << r.status().ToString();
    }
  }
}

TEST(PickleCorrupt, AWrongByteIsNotRunningOutOfBytes) {
  bool ran_out = true;
  const Asm bad = Asm().Proto(2).Op(0xff).Stop();
  EXPECT_FALSE(ParsePickle(bad.span(), "t", {}, &ran_out).ok());
  EXPECT_FALSE(ran_out);
  const Asm underflow = Asm().Proto(2).Op('t').Stop();  // TUPLE with no MARK
  ran_out = true;
  EXPECT_FALSE(ParsePickle(underflow.span(), "t", {}, &ran_out).ok());
  EXPECT_FALSE(ran_out);
}

TEST(PickleCorrupt, UnknownOpcodes) {
  for (uint8_t op : std::initializer_list<uint8_t>{0x00, 0x99, 0xff, 0x7f, 0x20}) {
    auto r = Parse(Asm().Proto(2).Op(op).Stop());
    ExpectError(r, StatusCode::kCorrupt, "unknown opcode");
  }
  ExpectError(Parse(Asm().Proto(6).None().Stop()), StatusCode::kUnsupported, "protocol 6");
  ExpectError(Parse(Asm().Proto(5).Op(0x97).Stop()), StatusCode::kUnsupported, "NEXT_BUFFER");
  ExpectError(Parse(Asm().Proto(5).Bytes("a").Op(0x98).Stop()), StatusCode::kUnsupported,
              "READONLY_BUFFER");
  ExpectError(Parse(Asm().Proto(2).Op(0x82).LE(1, 1).Stop()), StatusCode::kUnsupported, "EXT1");
  ExpectError(Parse(Asm()), StatusCode::kCorrupt, "truncated");
  ExpectError(Parse(Asm().Proto(2).None()), StatusCode::kCorrupt, "no STOP");
}

TEST(PickleCorrupt, StackUnderflowOnEveryPoppingOpcode) {
  struct Case {
    std::string name;
    Asm body;  // the opcode with its operands
  };
  std::vector<Case> cases;
  auto add = [&](std::string name, Asm a) { cases.push_back({std::move(name), std::move(a)}); };
  add("STOP", Asm());
  add("POP", Asm().Op('0'));
  add("DUP", Asm().Op('2'));
  add("TUPLE1", Asm().Op(0x85));
  add("TUPLE2", Asm().Int(1).Op(0x86));
  add("TUPLE3", Asm().Int(1).Int(2).Op(0x87));
  add("APPEND", Asm().Int(1).Op('a'));
  add("SETITEM", Asm().Int(1).Int(2).Op('s'));
  add("BUILD", Asm().Int(1).Op('b'));
  add("REDUCE", Asm().EmptyTuple().Op('R'));
  add("NEWOBJ", Asm().EmptyTuple().Op(0x81));
  add("NEWOBJ_EX", Asm().EmptyTuple().EmptyDict().Op(0x92));
  add("STACK_GLOBAL", Asm().ShortStr("m").Op(0x93));
  add("BINPERSID", Asm().Op('Q'));
  add("BINPUT", Asm().Op('q').LE(0, 1));
  add("LONG_BINPUT", Asm().Op('r').LE(0, 4));
  add("PUT", Asm().Op('p').Line("0"));
  add("MEMOIZE", Asm().Op(0x94));
  // Opcodes that need a MARK.
  for (uint8_t op : std::initializer_list<uint8_t>{'t', 'l', 'd', 'e', 'u', 0x90, 0x91, '1', 'o'}) {
    add(std::string("mark-op ") + static_cast<char>(op), Asm().Int(1).Op(op));
  }
  add("INST", Asm().Op('i').Line("m").Line("C"));
  // Targets below the MARK fence: APPENDS/SETITEMS/ADDITEMS need their target above it.
  add("APPENDS fenced", Asm().EmptyList().Mark().Mark().Int(1).Op('e'));
  add("APPEND fenced", Asm().EmptyList().Mark().Int(1).Op('a'));
  add("SETITEMS fenced", Asm().Mark().Int(1).Int(2).Op('u'));
  add("DUP fenced", Asm().Int(1).Mark().Op('2'));
  add("TUPLE2 fenced", Asm().Int(1).Mark().Int(2).Op(0x86));
  for (auto& c : cases) {
    SCOPED_TRACE(c.name);
    Asm a;
    a.Proto(2);
    a.Raw(std::string_view(reinterpret_cast<const char*>(c.body.bytes().data()),
                           c.body.size()));
    a.Stop();
    auto r = Parse(a);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kCorrupt) << r.status().ToString();
  }
}

TEST(PickleCorrupt, MarkNestingLimit) {
  Asm a;
  for (int i = 0; i < 100000; ++i) a.Mark();
  a.Stop();
  ExpectError(Parse(a), StatusCode::kResourceExhausted, "max_mark_depth");
}

TEST(PickleCorrupt, MemoIndices) {
  ExpectError(Parse(Asm().Op('h').LE(200, 1).Stop()), StatusCode::kCorrupt, "never set");
  ExpectError(Parse(Asm().Op('j').LE(0x80000000u, 4).Stop()), StatusCode::kCorrupt,
              "memo index 2147483648 was never set");
  ExpectError(Parse(Asm().Op('g').Line("2147483648").Stop()), StatusCode::kCorrupt,
              "memo index 2147483648 was never set");
  ExpectError(Parse(Asm().Op('g').Line("99999999999999999999999").Stop()), StatusCode::kCorrupt);
  ExpectError(Parse(Asm().Op('g').Line("x").Stop()), StatusCode::kCorrupt);
  // A huge LONG_BINPUT index is refused by the limit; nothing gigabyte-sized is allocated.
  ExpectError(Parse(Asm().None().Op('r').LE(0xFFFFFFFFu, 4).Stop()),
              StatusCode::kResourceExhausted, "max_memo");
  PickleLimits small;
  small.max_memo = 2;
  ExpectError(Parse(Asm().None().Memoize().Memoize().Memoize().Stop(), small),
              StatusCode::kResourceExhausted);
}

TEST(PickleCorrupt, HugeLengths) {
  ExpectError(Parse(Asm().Op(0x8d).LE(1ull << 62, 8).Raw("abc").Stop()), StatusCode::kCorrupt,
              "BINUNICODE8: truncated");
  ExpectError(Parse(Asm().Op(0x8e).LE(~0ull, 8).Stop()), StatusCode::kCorrupt, "truncated");
  ExpectError(Parse(Asm().Op(0x96).LE(1ull << 40, 8).Stop()), StatusCode::kCorrupt, "truncated");
  ExpectError(Parse(Asm().Op('X').LE(0xFFFFFFFFu, 4).Stop()), StatusCode::kCorrupt, "truncated");
  ExpectError(Parse(Asm().Op(0x8b).LE(0x7FFFFFFF, 4).Stop()), StatusCode::kCorrupt, "LONG4");
  ExpectError(Parse(Asm().Op(0x8b).LE(0xFFFFFFFFu, 4).Stop()), StatusCode::kCorrupt,
              "negative byte count");
  ExpectError(Parse(Asm().Op('T').LE(0xFFFFFFFFu, 4).Stop()), StatusCode::kCorrupt,
              "negative length");
  PickleLimits small;
  small.max_string_bytes = 4;
  ExpectError(Parse(Asm().Str("12345").Stop(), small), StatusCode::kResourceExhausted,
              "max_string_bytes");
  ExpectError(Parse(Asm().Op('V').Line("123456").Stop(), small), StatusCode::kResourceExhausted);
  // Decimal integers are bounded like CPython's int().
  ExpectError(Parse(Asm().Op('L').Line(std::string(5000, '7')).Stop()),
              StatusCode::kResourceExhausted, "digits");
}

TEST(PickleCorrupt, BadOperandTypes) {
  ExpectError(Parse(Asm().EmptyDict().Mark().Int(1).SetItems().Stop()), StatusCode::kCorrupt,
              "odd number");
  ExpectError(Parse(Asm().Mark().Int(1).Op('d').Stop()), StatusCode::kCorrupt, "odd number");
  ExpectError(Parse(Asm().EmptyTuple().Mark().Int(1).Int(2).SetItems().Stop()),
              StatusCode::kCorrupt, "SETITEMS: cannot set items on a Tuple");
  ExpectError(Parse(Asm().Int(1).Int(2).Int(3).SetItem().Stop()), StatusCode::kCorrupt);
  ExpectError(Parse(Asm().EmptyTuple().Int(1).Append().Stop()), StatusCode::kCorrupt,
              "cannot append to a Tuple");
  ExpectError(Parse(Asm().EmptyDict().Mark().Int(1).Op(0x90).Stop()), StatusCode::kCorrupt);
  ExpectError(Parse(Asm().Global("m", "f").Int(1).Reduce().Stop()), StatusCode::kCorrupt,
              "REDUCE: arguments are a Int, not a tuple");
  ExpectError(Parse(Asm().Int(1).EmptyTuple().Reduce().Stop()), StatusCode::kCorrupt,
              "not a class or function");
  ExpectError(Parse(Asm().Global("m", "C").Int(1).NewObj().Stop()), StatusCode::kCorrupt);
  ExpectError(Parse(Asm().Global("m", "C").EmptyTuple().Int(1).Op(0x92).Stop()),
              StatusCode::kCorrupt, "not a dict");
  ExpectError(Parse(Asm().Int(1).None().Build().Stop()), StatusCode::kCorrupt,
              "cannot set the state of a Int");
  ExpectError(Parse(Asm().Int(1).Int(2).Op(0x93).Stop()), StatusCode::kCorrupt, "must be str");
  ExpectError(Parse(Asm().Op('I').Line("1x").Stop()), StatusCode::kCorrupt);
  ExpectError(Parse(Asm().Op('F').Line("zz").Stop()), StatusCode::kCorrupt);
  ExpectError(Parse(Asm().Op('S').Line("noquote").Stop()), StatusCode::kCorrupt, "quoted");
  ExpectError(Parse(Asm().Op('S').Line("'bad\\x4'").Stop()), StatusCode::kCorrupt);
  ExpectError(Parse(Asm().Op('V').Line("\\u12").Stop()), StatusCode::kCorrupt);
  ExpectError(Parse(Asm().Op('V').Line("\\U00110000").Stop()), StatusCode::kCorrupt);
  ExpectError(Parse(Asm().Mark().Op('o').Stop()), StatusCode::kCorrupt);
}

TEST(PickleCorrupt, DeepNesting) {
  // 1e6 nested lists: the stack limit stops it cleanly.
  Asm a;
  for (int i = 0; i < 1000000; ++i) a.EmptyList();
  for (int i = 0; i < 999999; ++i) a.Append();
  a.Stop();
  PickleLimits limits;
  limits.max_stack = 65536;
  ExpectError(Parse(a, limits), StatusCode::kResourceExhausted, "max_stack");
  limits = {};
  limits.max_nodes = 1000;
  ExpectError(Parse(a, limits), StatusCode::kResourceExhausted, "max_nodes");

  // Within default limits the parser does not recurse: 200000 levels parse and walk.
  Asm b;
  constexpr int kDepth = 200000;
  for (int i = 0; i < kDepth; ++i) b.EmptyList();
  for (int i = 0; i < kDepth - 1; ++i) b.Append();
  b.Stop();
  auto r = Parse(b);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(WalkChecked(*r), static_cast<size_t>(kDepth));
}

TEST(PickleCorrupt, CopyAmplificationIsBounded) {
  // One memoized 100000-int tuple used as the shape and stride of many tensors.
  Asm a;
  a.Proto(2).Mark();
  for (int i = 0; i < 100000; ++i) a.Int(1);
  a.Tuple().BinPut(0).Op('0');
  a.Global("torch._utils", "_rebuild_tensor_v2").BinPut(1).Op('0');
  a.StoragePid("torch", "FloatStorage", "0", 1).BinPut(2).Op('0');
  for (int i = 0; i < 1000; ++i) {
    a.BinGet(1).Mark().BinGet(2).Int(0).BinGet(0).BinGet(0).False().None().Tuple().Reduce()
        .Op('0');
  }
  a.None().Stop();
  ExpectError(Parse(a), StatusCode::kResourceExhausted, "interpreted values copy");
  // One memoized 1 MB string used as the module and name of many globals.
  Asm b;
  b.Proto(4).Str(std::string(1 << 20, 'm')).BinPut(0);
  for (int i = 0; i < 100; ++i) b.BinGet(0).BinGet(0).Op(0x93).Op('0');
  b.Stop();
  ExpectError(Parse(b), StatusCode::kResourceExhausted, "interpreted values copy");
}

TEST(PickleCorrupt, NodeLimit) {
  PickleLimits limits;
  limits.max_nodes = 10;
  Asm a;
  a.EmptyList().Mark();
  for (int i = 0; i < 20; ++i) a.Int(1000 + i);
  a.Appends().Stop();
  ExpectError(Parse(a, limits), StatusCode::kResourceExhausted, "max_nodes");
  limits.max_nodes = 22;
  EXPECT_TRUE(Parse(a, limits).ok());
}

// Every byte of a valid pickle replaced by other values: never a crash, always a clean Status
// or a graph whose ids are all valid.
TEST(PickleCorrupt, ByteFlipsNeverCrash) {
  size_t parsed = 0, failed = 0;
  auto check = [&](std::vector<uint8_t> s, size_t i, uint8_t v) {
    s[i] = v;
    auto r = ParseBytes(s);
    if (r.ok()) {
      ++parsed;
      WalkChecked(*r);
    } else {
      ++failed;
      ASSERT_NE(r.status().message().find("test.pkl: pickle offset "), std::string::npos)
          << r.status().message();
    }
  };
  auto samples = ValidSamples();
  for (const auto& s : samples) {
    for (size_t i = 0; i < s.size(); ++i) {
      for (uint8_t x : std::initializer_list<uint8_t>{0x01, 0x02, 0x04, 0x08, 0x10, 0x20, 0x40,
                                                     0x80, 0xff}) {
        check(s, i, static_cast<uint8_t>(s[i] ^ x));
      }
    }
  }
  // Every value at every position of a tensor pickle that goes through the whitelist.
  const auto tensor = ReadFile(DataDir().parent_path() / "fuzz" / "seeds" / "pickle_tensor_v3.bin");
  ASSERT_FALSE(tensor.empty());
  for (size_t i = 0; i < tensor.size(); ++i) {
    for (int v = 0; v < 256; ++v) check(tensor, i, static_cast<uint8_t>(v));
  }
  EXPECT_GT(parsed, 0u);
  EXPECT_GT(failed, 0u);
}

// ---------------------------------------------------------------------------------------------
// Performance: a ~10 MB DCP-like metadata pickle (protocol 4, MEMOIZE after everything).

// A ~10 MB DCP-like metadata pickle (protocol 4, MEMOIZE after everything); *n_entries is the
// number of state_dict_metadata entries.
Asm TenMegabyteMetadata(int* n_entries) {
  Asm a;
  a.Proto(4).StackGlobal("torch.distributed.checkpoint.metadata", "Metadata").Memoize()
      .EmptyTuple().NewObj().Memoize().EmptyDict().Memoize().ShortStr("state_dict_metadata")
      .Memoize().EmptyDict().Memoize();
  // memo: 0 Metadata, 1 obj, 2 state dict, 3 key, 4 sdm dict
  a.StackGlobal("torch.distributed.checkpoint.metadata", "TensorStorageMetadata").BinPut(5);
  a.StackGlobal("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata").BinPut(6);
  a.StackGlobal("torch", "Size").BinPut(7);
  a.ShortStr("size").BinPut(8).ShortStr("chunks").BinPut(9).ShortStr("offsets").BinPut(10)
      .ShortStr("sizes").BinPut(11).Op('0').Op('0').Op('0').Op('0').Op('0').Op('0').Op('0');
  int n = 0;
  while (a.size() < 10u * 1000 * 1000) {
    a.Mark();
    for (int k = 0; k < 100; ++k, ++n) {
      a.ShortStr("layers." + std::to_string(n) + ".mlp.weight").Memoize();
      a.BinGet(5).EmptyTuple().NewObj().Memoize().EmptyDict().Memoize().Mark();
      a.BinGet(8).BinGet(7).Int(n).Int(4096).Tuple2().Memoize().Tuple1().Memoize().Reduce()
          .Memoize();
      a.BinGet(9).EmptyList().Memoize().Mark();
      for (int c = 0; c < 2; ++c) {
        a.BinGet(6).EmptyTuple().NewObj().Memoize().EmptyDict().Memoize().Mark();
        a.BinGet(10).BinGet(7).Int(c * 2048).Int(0).Tuple2().Memoize().Tuple1().Memoize()
            .Reduce().Memoize();
        a.BinGet(11).BinGet(7).Int(2048).Int(4096).Tuple2().Memoize().Tuple1().Memoize()
            .Reduce().Memoize();
        a.SetItems().Build();
      }
      a.Appends().SetItems().Build();
    }
    a.SetItems();
  }
  a.SetItem().Build().Stop();
  *n_entries = n;
  return a;
}

TEST(PicklePerf, TenMegabyteMetadata) {
  int n = 0;
  const Asm a = TenMegabyteMetadata(&n);
  const auto start = std::chrono::steady_clock::now();
  auto r = Parse(a);
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  std::printf("parsed %zu bytes, %d entries, %zu nodes in %.3f s\n", a.size(), n, r->size(), secs);
  EXPECT_EQ(r->ClassName(r->root()), "Metadata");
  const NodeId sdm = r->DictGet(r->object(r->root()).state, "state_dict_metadata");
  ASSERT_NE(sdm, kNoNode);
  EXPECT_EQ(r->dict_items(sdm).size(), static_cast<size_t>(n));
  EXPECT_LT(secs, 10.0);
}

// The graph's own memory (capacities of everything it holds, text included) per node. Nodes are
// 16 bytes; payloads live in side tables, so DCP metadata costs ~40 bytes a node where the
// struct-per-node graph cost ~400.
TEST(PicklePerf, MemoryPerNode) {
  int n = 0;
  const Asm a = TenMegabyteMetadata(&n);
  auto r = Parse(a);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_GT(r->size(), 1000000u);
  const double per_node = static_cast<double>(r->MemoryBytes()) / static_cast<double>(r->size());
  std::printf("%zu nodes, %zu bytes held, %.1f bytes/node\n", r->size(), r->MemoryBytes(),
              per_node);
  EXPECT_LE(per_node, 80.0);
  // Text is counted: a graph holding one 1 MB string holds at least that much.
  auto big = Parse(Asm().Proto(4).Str(std::string(1 << 20, 'x')).Stop());
  ASSERT_TRUE(big.ok()) << big.status().ToString();
  EXPECT_GE(big->MemoryBytes(), size_t{1} << 20);
  EXPECT_LT(big->MemoryBytes(), size_t{3} << 20);
}

}  // namespace
}  // namespace ucpfs::pickle
