"""End-to-end: the documentation covers the program as it is.
- For every subcommand of `ucpfs --help`: its help has a description for every option; the man
  page (dist/ucpfs.1) has a section for it naming each of its long options; the reference
  (docs/reference.md) names each option; the bash completion (dist/ucpfs.bash), run in a real
  bash, offers the subcommand and each option. `man` renders the page without warnings.
- README.md and docs/*.md: every relative link and its #anchor resolve, every repository path
  they name exists, and the README's "Layout of the source tree" names every top-level folder.
- Code comments that cite a section of docs/ (`docs/design.md "Data model"`) name a heading that
  page has, and nothing cites the design notes and research folder that are not in the
  repository.
"""
import os
import re
import shutil
import subprocess

from e2e_common import Results, run, ucpfs_bin

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
MAN = os.path.join(ROOT, "dist", "ucpfs.1")
COMPLETION = os.path.join(ROOT, "dist", "ucpfs.bash")
REFERENCE = os.path.join(ROOT, "docs", "reference.md")
# Top-level folders of the repository: paths in the docs that start with one must exist.
# The design notes and research folder the code was written from: not in the repository, so
# nothing may cite them (docs/design.md and docs/formats.md say what the code relies on).
NOT_IN_REPOSITORY = r"\bDESIGN\.md|\bresearch/|torch-formats\.md|fuse-io\.md"
REPO_DIRS = ("core/", "index/", "fs/", "cli/", "tests/", "mount-examples/", "dist/", "docs/", ".ci/")


def subcommands(exe):
    text = run([exe, "--help"]).stdout
    section = text.split("Subcommands:", 1)[1]
    return [m.group(1) for m in re.finditer(r"^  ([a-z][a-z-]*) ", section, re.M)]


def options(exe, sub):
    """{option: help text} of `ucpfs SUB --help` (long options, and short ones without a long form)."""
    text = run([exe, sub, "--help"]).stdout
    section = text.split("Options:", 1)[1]
    found = {}
    lines = section.splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"^  (-[^ ]+)(.*)$", line)
        if not m:
            continue
        names = m.group(1).split(",")
        rest = m.group(2).strip()
        # CLI11 puts the help after the type (TEXT, UINT, ...) or on the next line when the
        # option is long.
        rest = re.sub(r"^(TEXT|UINT|INT|FLOAT|\.\.\.| )+", "", rest).strip()
        if not rest and i + 1 < len(lines) and lines[i + 1].startswith("      "):
            rest = lines[i + 1].strip()
        names = [re.sub(r"\{.*$", "", n) for n in names]  # CLI11's "--flag{default}=1" spelling
        long_names = [n for n in names if n.startswith("--")]
        for n in long_names or names:
            found[n] = rest
    return found


def man_section(man, sub):
    m = re.search(r'^\.SS "ucpfs %s\b.*?$(.*?)(?=^\.S[SH] )' % re.escape(sub), man, re.M | re.S)
    return m.group(1) if m else None


def names_option(text, opt):
    """Whether `text` names the option `opt` itself (`--atomic` is not named by `--no-atomic`)."""
    return re.search(r"(?<![\w-])%s(?![\w-])" % re.escape(opt), text) is not None


def doc_pages():
    """{path relative to ROOT: text} of README.md and every page of docs/."""
    pages = {"README.md": open(os.path.join(ROOT, "README.md")).read()}
    for name in sorted(os.listdir(os.path.join(ROOT, "docs"))):
        if name.endswith(".md"):
            pages["docs/" + name] = open(os.path.join(ROOT, "docs", name)).read()
    return pages


def heading_anchors(text):
    """The #anchors GitHub gives the headings of a markdown page (duplicates get -1, -2, ...)."""
    anchors, seen = set(), {}
    in_code = False
    for line in text.splitlines():
        if line.startswith("```"):
            in_code = not in_code
        m = re.match(r"^#{1,6} (.*)$", line)
        if in_code or not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else "%s-%d" % (slug, n))
    return anchors


def headings(text):
    return {m.group(1).strip() for m in re.finditer(r"^#{1,6} (.*)$", text, re.M)}


def complete(words):
    """What the completion offers for the command line `words` (the last word is being typed)."""
    script = "source %s\nCOMP_WORDS=(%s)\nCOMP_CWORD=%d\n_ucpfs\nprintf '%%s\\n' \"${COMPREPLY[@]}\"\n" % (
        COMPLETION, " ".join("'%s'" % w for w in words), len(words) - 1)
    env = dict(os.environ, PATH=os.path.dirname(ucpfs_bin()) + ":" + os.environ.get("PATH", ""))
    r = subprocess.run(["bash", "--norc", "--noprofile", "-c", script], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    return set(r.stdout.split())


def main():
    res = Results("e2e_docs")
    exe = ucpfs_bin()
    man = open(MAN).read()
    reference = open(REFERENCE).read()
    subs = subcommands(exe)

    def all_subcommands():
        assert {"mount", "umount", "sync", "status", "index", "inspect", "convert"} <= set(subs), subs
        offered = complete(["ucpfs", ""])
        assert set(subs) <= offered, (subs, offered)
        for sub in subs:
            assert man_section(man, sub) is not None, "dist/ucpfs.1 has no section .SS \"ucpfs %s\"" % sub
    res.check("every subcommand has a man section and is completed", all_subcommands)

    for sub in subs:
        def covered(sub=sub):
            section = man_section(man, sub)
            opts = options(exe, sub)
            assert opts, sub
            missing_help = [o for o, text in opts.items() if o != "--help" and not text]
            assert not missing_help, "%s: options without help text: %s" % (sub, missing_help)
            missing_man = [o for o in opts if o != "--help" and o.replace("-", "\\-") not in section]
            assert not missing_man, "dist/ucpfs.1, section %s, does not name %s" % (sub, missing_man)
            missing_ref = [o for o in opts if o != "--help" and not names_option(reference, o)]
            assert not missing_ref, "docs/reference.md does not name %s of `ucpfs %s`" % (missing_ref, sub)
            offered = complete(["ucpfs", sub, "-"])
            missing_completion = [o for o in opts if o not in offered]
            assert not missing_completion, "completion of `ucpfs %s -` lacks %s" % (sub, missing_completion)
        res.check("%s: help, man page and completion name every option" % sub, covered)

    def preset_values():
        assert complete(["ucpfs", "mount", "--preset", "m"]) == {"megatron"}
    res.check("completion offers --preset values", preset_values)

    pages = doc_pages()

    def links_resolve():
        bad = []
        for page, text in pages.items():
            text = re.sub(r"^    .*$", "", text, flags=re.M)  # indented code blocks hold no links
            for target in re.findall(r"\]\(([^)\s]+)\)", text):
                if re.match(r"^[a-z]+:", target):
                    continue  # http:, mailto:
                path, _, anchor = target.partition("#")
                full = os.path.normpath(os.path.join(ROOT, os.path.dirname(page), path)) if path \
                    else os.path.join(ROOT, page)
                if not os.path.exists(full):
                    bad.append("%s: %s (no such file)" % (page, target))
                elif anchor and full.endswith(".md") and anchor not in heading_anchors(open(full).read()):
                    bad.append("%s: %s (no such heading)" % (page, target))
        assert not bad, "\n".join(bad)
    res.check("README.md and docs/: every relative link and anchor resolves", links_resolve)

    def paths_exist():
        bad = []
        for page, text in pages.items():
            for span in re.findall(r"`([^`\s]+)`", text):
                path = span.split(":")[0].rstrip(".,")
                if not path.startswith(REPO_DIRS) or re.search(r"[<>*{}\[\]$]", path):
                    continue
                if not os.path.exists(os.path.join(ROOT, path)):
                    bad.append("%s: `%s`" % (page, span))
        assert not bad, "paths named in the docs that do not exist:\n" + "\n".join(bad)
    res.check("README.md and docs/: every repository path they name exists", paths_exist)

    def source_tree_table():
        r = subprocess.run(["git", "-C", ROOT, "ls-files"], capture_output=True, text=True)
        if r.returncode != 0:
            print("  (not a git checkout: the table is not compared with the tracked folders)")
            return
        folders = {f.split("/")[0] for f in r.stdout.splitlines() if "/" in f}
        section = pages["README.md"].split("## Layout of the source tree", 1)[1]
        missing = sorted(d for d in folders if "`%s/`" % d not in section)
        assert not missing, "README.md's \"Layout of the source tree\" lacks %s" % missing
    res.check("README.md's \"Layout of the source tree\" names every top-level folder", source_tree_table)

    def code_citations():
        bad = []
        docs = {page[len("docs/"):]: headings(text) for page, text in pages.items() if page.startswith("docs/")}
        for top in ("core", "index", "fs", "cli", "tests", "mount-examples", "dist"):
            for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
                for name in files:
                    if not name.endswith((".h", ".cc", ".c", ".py", ".sh", ".md", ".txt")):
                        continue
                    path = os.path.join(dirpath, name)
                    rel = os.path.relpath(path, ROOT)
                    text = open(path, errors="replace").read()
                    text = re.sub(r"\n\s*(//|#)\s*", " ", text)  # join comment lines
                    if rel != "tests/e2e/docs_test.py" and re.search(NOT_IN_REPOSITORY, text):
                        bad.append("%s cites a document that is not in the repository" % rel)
                    for page, section in re.findall(r"docs/(\w+\.md)\)?,? \"([^\"]+)\"", text):
                        if page not in docs or section not in docs[page]:
                            bad.append('%s cites docs/%s "%s", which has no such heading' % (rel, page, section))
        assert not bad, "\n".join(bad)
    res.check("code comments cite sections docs/ has", code_citations)

    if shutil.which("man"):
        def renders():
            r = subprocess.run(["man", "--warnings", "-l", MAN], capture_output=True, text=True,
                               env=dict(os.environ, MANWIDTH="100", MAN_KEEP_FORMATTING="0"))
            assert r.returncode == 0 and "ucpfs - mount a distributed training checkpoint" in r.stdout, r.stderr
            assert not r.stderr.strip(), r.stderr
        res.check("man renders dist/ucpfs.1 without warnings", renders)
    res.finish()


if __name__ == "__main__":
    main()
