# SPDX-License-Identifier: Apache-2.0
"""The user documentation stays true to the repository: README.md is short,
starts with `make demo` and `make test`, names only Makefile targets that
exist and only options microd (or the other program named below) has, and
its flags table gives microd's defaults; README.md, CONTRIBUTING.md and
docs/*.md name or link only paths that exist inside the repository; the C
and Python names in README.md, docs/c-api.md and docs/python.md exist. No
build needed."""
import glob
import os
import re

import pytest

import deploy_lib as d

README = os.path.join(d.ROOT, "README.md")
CONTRIBUTING = os.path.join(d.ROOT, "CONTRIBUTING.md")
DOCS = sorted(glob.glob(os.path.join(d.ROOT, "docs", "*.md")))
CHECKED = [README, CONTRIBUTING] + DOCS
FLAGS = d.microd_flags()
MAX_README_LINES = 250

# Options of the other programs README.md shows (launch.sh, the make
# variables' scripts, microctl, ...), each checked against its source below so
# that this list cannot drift either. A `--x` in README.md must be a flag of
# microd or one of these.
OTHER_PROGRAMS = {
    "deploy/local/launch.sh": ["nodes", "local", "net-rate", "net-delay", "net-loss", "netlab",
                               "daemon-arg", "microd", "logs", "show-first"],
    "scripts/demo.sh": ["nodes", "local", "density", "sparsifier", "controller", "epochs",
                        "momentum-correction", "warmup-steps"],
    "scripts/bench.sh": ["network-only", "skip-network", "skip-training", "smoke", "out",
                         "tta-latency"],
    "scripts/install-deps.sh": ["build", "fuzz", "gpu-bundle"],
    "scripts/build-install.sh": ["prefix", "build-dir"],
    "bench/training/run.py": ["netlab-rate", "budget", "methods", "steps"],
    "bench/network/run.py": ["latency", "seal-cost"],
    "examples/fashion_mnist/remedies.sh": ["epochs", "only", "out"],
    "daemon/microctl_main.cc": ["admin", "json", "history", "seconds", "out"],
    "daemon/sim/microd_sim.cc": ["size", "density", "steps", "controller"],
}
EXTERNAL_OPTIONS = {"no-build-isolation"}  # pip's


def _read(path):
    with open(path) as f:
        return f.read()


def _rel(path):
    return os.path.relpath(path, d.ROOT)


def _fenced_blocks(text):
    return re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.S | re.M)


def _without_fenced(text):
    return re.sub(r"^```[^\n]*\n.*?^```", "", text, flags=re.S | re.M)


def _inline_spans(text):
    return re.findall(r"`([^`\n]+)`", _without_fenced(text))


def _code(text):
    """Every piece of code in a Markdown text: fenced blocks and inline spans."""
    return _fenced_blocks(text) + _inline_spans(text)


def _makefile_targets():
    targets = set()
    for line in _read(os.path.join(d.ROOT, "Makefile")).splitlines():
        m = re.match(r"^([A-Za-z0-9_.-][A-Za-z0-9_. -]*?)\s*:(?!=)", line)
        if m:
            targets.update(t for t in m.group(1).split() if not t.startswith("."))
    return targets


_MAKE = re.compile(r"(?:^|[\s;&|(])((?:[A-Z_]+=\S+\s+)*)make((?:\s+[A-Z_]+=(?:\"[^\"]*\"|\S+))*)"
                   r"\s+([a-z][\w-]*)((?:\s+[A-Z_]+=(?:\"[^\"]*\"|\S+))*)")


def _make_commands(path):
    """(target, [VARIABLE, ...]) of every `make TARGET` in the file's code."""
    out = []
    for code in _code(_read(path)):
        for m in _MAKE.finditer(code):
            variables = re.findall(r"(?:^|\s)([A-Z_]+)=", m.group(1) + m.group(2) + m.group(4))
            out.append((m.group(3), variables))
    return out


def _top_level_entries():
    """What a repository path may start with: the tracked top-level entries
    (build outputs and results are not the repository's)."""
    ignored = ("build", "results")
    return {e for e in os.listdir(d.ROOT)
            if e != ".git" and not any(e == i or e.startswith(i + "-") for i in ignored)}


def _words(code):
    words = (w.lstrip("(").rstrip(".,;:)") for w in re.split(r"[\s=,'\"]+", code))
    return [w for w in words if w]


def _repo_paths(path, top):
    """Words of the file's code that name a repository path (relative to the
    root: they start with a top-level entry), and words that start with ../."""
    names, outside = set(), set()
    for code in _code(_read(path)):
        for w in _words(code):
            if w.startswith("../"):
                outside.add(w)
            elif w.split("/")[0] in top and "/" in w or w in top:
                names.add(w)
    return names, outside


def _links(path):
    text = _without_fenced(_read(path))
    text = re.sub(r"`[^`\n]+`", "", text)
    return re.findall(r"\]\(\s*([^)\s]+)(?:\s+\"[^\"]*\")?\s*\)", text)


def _slug(heading):
    s = heading.strip().lower()
    s = re.sub(r"[^\w\s-]", "", s)
    return re.sub(r"\s", "-", s)


def _anchors(path):
    return {_slug(m) for m in re.findall(r"^#+\s+(.*)$", _without_fenced(_read(path)), flags=re.M)}


# --- README's shape ------------------------------------------------------------

def test_readme_is_short():
    n = len(_read(README).splitlines())
    assert n <= MAX_README_LINES, f"README.md has {n} lines (at most {MAX_README_LINES})"


@pytest.mark.parametrize("doc", ["CONTRIBUTING.md", "docs/design.md", "docs/benchmarks.md",
                                 "docs/c-api.md", "docs/python.md"])
def test_the_documentation_exists(doc):
    assert os.path.isfile(os.path.join(d.ROOT, doc)), f"{doc} is missing"


def test_readme_starts_with_the_two_commands():
    first = _fenced_blocks(_read(README))[0]
    assert re.search(r"^make demo\b", first, flags=re.M), first
    assert re.search(r"^make test\b", first, flags=re.M), first


# --- make targets ----------------------------------------------------------------

@pytest.mark.parametrize("path", [README, CONTRIBUTING], ids=_rel)
def test_make_targets_exist(path):
    targets = _makefile_targets()
    assert {"demo", "test", "bench"} <= targets, targets
    commands = _make_commands(path)
    assert commands, f"{_rel(path)} names no make command"
    missing = sorted({t for t, _ in commands if t not in targets})
    assert not missing, f"{_rel(path)} names make targets the Makefile lacks: {missing}"


@pytest.mark.parametrize("path", [README, CONTRIBUTING], ids=_rel)
def test_make_variables_are_read(path):
    """A VARIABLE=... given to make is read by the Makefile or by a script."""
    sources = _read(os.path.join(d.ROOT, "Makefile")) + "".join(
        _read(p) for p in glob.glob(os.path.join(d.ROOT, "scripts", "*.sh")))
    unread = sorted({v for _, vs in _make_commands(path) for v in vs
                     if not re.search(rf"\b{v}\b", sources)})
    assert not unread, f"{_rel(path)} sets make variables nothing reads: {unread}"


# --- flags -------------------------------------------------------------------

def _readme_flag_rows():
    rows = {}
    for line in _read(README).splitlines():
        m = re.match(r"\| `--([\w-]+)` \| (`[^`]*`|\(empty\)) \| (.+) \|$", line.strip())
        if m:
            rows[m.group(1)] = (m.group(2).strip("`"), m.group(3))
    return rows


def test_readme_flags_table_names_real_flags_with_their_defaults():
    rows = _readme_flag_rows()
    assert len(rows) >= 10, "README.md's flags table has too few rows (format changed?)"
    unknown = sorted(set(rows) - set(FLAGS))
    assert not unknown, f"README.md's flags table names flags microd lacks: {unknown}"
    wrong = [(n, doc, FLAGS[n]["default"]) for n, (doc, _) in rows.items()
             if not d.same_default(doc, FLAGS[n]["default"])]
    assert not wrong, f"README.md's defaults differ from daemon/flags.cc: {wrong}"


def test_other_programs_have_the_options_listed_for_them():
    for program, options in OTHER_PROGRAMS.items():
        src = _read(os.path.join(d.ROOT, program))
        for o in options:
            if program.endswith(".cc"):
                ok = re.search(rf"ABSL_FLAG\([\w:]+, {re.escape(o)},", src)
            else:
                ok = f"--{o}" in src
            assert ok, f"{program} has no option --{o}"


def test_every_option_in_readme_is_real():
    others = {o for opts in OTHER_PROGRAMS.values() for o in opts} | EXTERNAL_OPTIONS
    named = set(re.findall(r"(?<![\w-])--([a-z][\w-]*)", _read(README)))
    unknown = sorted(o for o in named if o not in FLAGS and o not in others)
    assert not unknown, (f"README.md names options that are neither microd flags nor "
                         f"listed for another program here: {unknown}")


# --- paths -------------------------------------------------------------------

@pytest.mark.parametrize("path", CHECKED, ids=_rel)
def test_named_paths_exist_inside_the_repository(path):
    assert os.path.isfile(path), f"{_rel(path)} is missing"
    names, outside = _repo_paths(path, _top_level_entries())
    assert not outside, f"{_rel(path)} names paths outside the repository: {sorted(outside)}"
    missing = sorted(n for n in names if not os.path.exists(os.path.join(d.ROOT, n)))
    assert not missing, f"{_rel(path)} names paths that do not exist: {missing}"


@pytest.mark.parametrize("path", CHECKED, ids=_rel)
def test_links_resolve_inside_the_repository(path):
    here = os.path.dirname(path)
    bad = []
    for target in _links(path):
        if re.match(r"^[a-z]+:", target):
            continue  # https:, mailto:
        file_part, _, anchor = target.partition("#")
        dest = os.path.normpath(os.path.join(here, file_part)) if file_part else path
        if os.path.commonpath([dest, d.ROOT]) != d.ROOT:
            bad.append(f"{target} (outside the repository)")
        elif not os.path.exists(dest):
            bad.append(f"{target} (missing)")
        elif anchor and dest.endswith(".md") and anchor not in _anchors(dest):
            bad.append(f"{target} (no such heading)")
    assert not bad, f"{_rel(path)}: {bad}"


@pytest.mark.parametrize("path", CHECKED, ids=_rel)
def test_markdown_files_named_exist(path):
    """Every *.md the text names (in prose too) is a file of the repository;
    nothing points to documents kept outside it."""
    text = _read(path)
    assert "../shared" not in text, f"{_rel(path)} points outside the repository"
    here = os.path.dirname(path)
    missing = []
    for name in set(re.findall(r"(?<![\w/.-])((?:\.\./|[\w.-]+/)*[\w.-]+\.md)\b", text)):
        if name.split("/")[0] in ("build", "results"):
            continue  # written by the programs
        candidates = [os.path.normpath(os.path.join(base, name)) for base in (d.ROOT, here)]
        if not any(os.path.commonpath([c, d.ROOT]) == d.ROOT and os.path.isfile(c)
                   for c in candidates):
            missing.append(name)
    assert not missing, f"{_rel(path)} names Markdown files the repository lacks: {sorted(missing)}"


# --- API names -----------------------------------------------------------------

def test_c_api_names_exist():
    header = _read(os.path.join(d.ROOT, "client", "include", "microd", "microd.h"))
    for path in [README, os.path.join(d.ROOT, "docs", "c-api.md")]:
        named = set(re.findall(r"\b(microd_[a-z_]+|MICROD_(?:ERR_[A-Z_]+|OK|BUFFER_[A-Z]+))\b",
                               _read(path)))
        missing = sorted(n for n in named if not re.search(rf"\b{n}\b", header))
        assert not missing, f"{_rel(path)} names C API symbols microd.h lacks: {missing}"


FILE_SUFFIXES = {"h", "pc", "sock", "so", "c"}  # microd.h, microd.pc: files, not Python


def test_python_names_exist():
    package = os.path.join(d.ROOT, "client", "python", "microd")
    defined = {}
    for module, file in (("microd", "__init__.py"), ("mt", "torch/__init__.py"),
                         ("elastic", "torch/elastic.py")):
        src = _read(os.path.join(package, file))
        defined[module] = set(re.findall(r"^(?:def|class) (\w+)|^(\w+) = ", src, flags=re.M))
        defined[module] = {a or b for a, b in defined[module]}
    defined["microd"].add("torch")
    defined["mt"].add("elastic")
    for path in [README, os.path.join(d.ROOT, "docs", "python.md")]:
        text = "\n".join(_code(_read(path)))
        found = re.findall(r"(?<![\w/.-])(microd|mt|elastic)\.(\w+)", text)
        missing = sorted({f"{m}.{n}" for m, n in found
                          if n not in defined[m] and n not in FILE_SUFFIXES})
        assert not missing, f"{_rel(path)} names Python names the package lacks: {missing}"
