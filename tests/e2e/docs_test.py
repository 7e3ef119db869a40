"""End-to-end: the manual page (dist/ucpfs.1) and the bash completion (dist/ucpfs.bash) cover the
program as it is. For every subcommand of `ucpfs --help`: its help has a description for every
option; the man page has a section for it naming each of its long options; the completion, run
in a real bash, offers the subcommand and each option. `man` renders the page without warnings.
"""
import os
import re
import shutil
import subprocess

from e2e_common import Results, run, ucpfs_bin

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
MAN = os.path.join(ROOT, "dist", "ucpfs.1")
COMPLETION = os.path.join(ROOT, "dist", "ucpfs.bash")


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
            offered = complete(["ucpfs", sub, "-"])
            missing_completion = [o for o in opts if o not in offered]
            assert not missing_completion, "completion of `ucpfs %s -` lacks %s" % (sub, missing_completion)
        res.check("%s: help, man page and completion name every option" % sub, covered)

    def preset_values():
        assert complete(["ucpfs", "mount", "--preset", "m"]) == {"megatron"}
    res.check("completion offers --preset values", preset_values)

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
