# SPDX-License-Identifier: Apache-2.0
"""Readers for the deployment tests: microd's flags (from daemon/flags.cc), the
Dockerfile's stages, and a small kustomize resolver (base + overlays:
resources, strategic-merge patches, images, secretGenerator) for the
manifests under deploy/k8s. kubectl is not a dependency; where it exists,
test_k8s.py checks the resolver against `kubectl kustomize`."""
import copy
import fnmatch
import os
import re
import shlex

import yaml

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
MICROD_FLAGS = os.path.join(ROOT, "daemon", "flags.cc")
MICROD_DAEMON = os.path.join(ROOT, "daemon", "daemon.cc")


# --- microd's flags -----------------------------------------------------------

def _split_args(text):
    """Top-level comma split of a C argument list (strings and parens kept)."""
    args, depth, cur, i = [], 0, "", 0
    while i < len(text):
        ch = text[i]
        if ch == '"':
            j = i + 1
            while text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            cur += text[i:j + 1]
            i = j + 1
            continue
        if ch in "({":
            depth += 1
        elif ch in ")}":
            depth -= 1
        if ch == "," and depth == 0:
            args.append(cur.strip())
            cur = ""
        else:
            cur += ch
        i += 1
    args.append(cur.strip())
    return args


def _c_string(expr):
    """Value of adjacent C string literals ("a" "b" -> "ab")."""
    parts = re.findall(r'"((?:[^"\\]|\\.)*)"', expr)
    return "".join(bytes(p, "utf-8").decode("unicode_escape") for p in parts)


def microd_flags(path=MICROD_FLAGS):
    """{name: {"type", "default", "help"}} of every ABSL_FLAG in daemon/flags.cc."""
    src = open(path).read()
    flags = {}
    for m in re.finditer(r"\bABSL_FLAG\(", src):
        depth, i = 1, m.end()
        while depth:
            if src[i] == '"':
                i += 1
                while src[i] != '"':
                    i += 2 if src[i] == "\\" else 1
            elif src[i] == "(":
                depth += 1
            elif src[i] == ")":
                depth -= 1
            i += 1
        type_, name, default, *help_ = _split_args(src[m.end():i - 1])
        default = _c_string(default) if default.startswith('"') else default
        flags[name] = {"type": type_, "default": default, "help": _c_string(",".join(help_))}
    return flags


def health_service_name(path=MICROD_DAEMON):
    m = re.search(r'constexpr char kHealthService\[\] = "([^"]*)";', open(path).read())
    assert m, "kHealthService not found in daemon/daemon.cc"
    return m.group(1)


# --- Dockerfile -------------------------------------------------------------------

class Stage:
    def __init__(self, base, name, index):
        self.base, self.name, self.index = base, name, index
        self.instructions = []  # (KEYWORD, argument text)

    def all(self, keyword):
        return [a for k, a in self.instructions if k == keyword]


def parse_dockerfile(path):
    """(global ARGs {name: default}, [Stage]). Handles comments, line
    continuations and parser directives; enough for this repository's file."""
    lines, cur = [], ""
    for raw in open(path).read().splitlines():
        s = raw.strip()
        if not cur and (not s or s.startswith("#")):
            continue
        if s.startswith("#"):  # a comment inside a continued instruction
            continue
        if s.endswith("\\"):
            cur += s[:-1] + " "
            continue
        lines.append(cur + s)
        cur = ""
    assert not cur, "Dockerfile ends inside a continued line"
    global_args, stages = {}, []
    for line in lines:
        keyword, _, arg = line.partition(" ")
        keyword, arg = keyword.upper(), arg.strip()
        if keyword == "FROM":
            words = arg.split()
            words = [w for w in words if not w.startswith("--platform")]
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            assert len(words) in (1, 3), f"bad FROM: {line}"
            stages.append(Stage(words[0], name, len(stages)))
        elif not stages:
            assert keyword == "ARG", f"{keyword} before the first FROM"
            n, _, d = arg.partition("=")
            global_args[n] = d
        else:
            stages[-1].instructions.append((keyword, arg))
    return global_args, stages


def copy_sources(arg):
    """(--from value or None, [sources], destination) of a COPY/ADD argument."""
    if arg.startswith("["):
        words = yaml.safe_load(arg)
        flags = []
    else:
        words = shlex.split(arg)
        flags = [w for w in words if w.startswith("--")]
        words = [w for w in words if not w.startswith("--")]
    src_from = None
    for f in flags:
        if f.startswith("--from="):
            src_from = f.split("=", 1)[1]
    return src_from, words[:-1], words[-1]


def dockerignore_patterns(root=ROOT):
    path = os.path.join(root, ".dockerignore")
    if not os.path.exists(path):
        return []
    out = []
    for line in open(path):
        line = line.strip()
        if line and not line.startswith("#"):
            out.append(line.rstrip("/"))
    return out


def dockerignored(relpath, patterns):
    """Whether .dockerignore keeps `relpath` (or a folder above it) out of the
    context (Go filepath.Match semantics plus **, no ! exceptions)."""
    assert not any(p.startswith("!") for p in patterns), "! exceptions are not handled"
    parts = relpath.strip("/").split("/")
    for n in range(1, len(parts) + 1):
        prefix = "/".join(parts[:n])
        for p in patterns:
            if p.startswith("**/"):
                if fnmatch.fnmatchcase(parts[n - 1], p[3:]):
                    return True
            elif p.count("/") == prefix.count("/") and fnmatch.fnmatchcase(prefix, p):
                return True
    return False


# --- kustomize ---------------------------------------------------------------------

# List merge keys of the strategic merge patch for the fields these
# manifests use (Kubernetes' patchMergeKey).
_MERGE_KEYS = {"containers": "name", "initContainers": "name", "env": "name",
               "volumes": "name", "volumeMounts": "mountPath", "ports": "containerPort",
               "envFrom": None}
_SUPPORTED = {"apiVersion", "kind", "resources", "patches", "images", "secretGenerator",
              "generatorOptions"}


def _smp(base, patch, field=None):
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for k, v in patch.items():
            if v is None:
                out.pop(k, None)
            elif k in out:
                out[k] = _smp(out[k], v, k)
            else:
                out[k] = copy.deepcopy(v)
        return out
    if isinstance(base, list) and isinstance(patch, list) and _MERGE_KEYS.get(field):
        key = _MERGE_KEYS[field]
        out = [copy.deepcopy(x) for x in base]
        added = []
        for item in patch:
            match = [i for i, x in enumerate(out) if x.get(key) == item.get(key)]
            if match:
                out[match[0]] = _smp(out[match[0]], item, None)
            else:
                added.append(copy.deepcopy(item))
        # kustomize puts the items a patch adds before the base's.
        return added + out
    return copy.deepcopy(patch)


def _load_docs(path):
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def _pod_containers(obj):
    spec = obj.get("spec", {}).get("template", {}).get("spec", {})
    return spec.get("initContainers", []) + spec.get("containers", [])


def kustomize(directory):
    """Resources of the kustomization in `directory`, as a list of dicts.
    Raises on any kustomization field it does not implement."""
    kfile = os.path.join(directory, "kustomization.yaml")
    (k,) = _load_docs(kfile)
    unknown = set(k) - _SUPPORTED
    if unknown:
        raise NotImplementedError(f"{kfile}: unsupported fields {sorted(unknown)}")
    out = []
    for r in k.get("resources", []):
        path = os.path.normpath(os.path.join(directory, r))
        out += kustomize(path) if os.path.isdir(path) else _load_docs(path)
    opts = k.get("generatorOptions", {})
    for g in k.get("secretGenerator", []):
        if not opts.get("disableNameSuffixHash"):
            raise NotImplementedError("secretGenerator with a name hash suffix")
        unknown = set(g) - {"name", "files", "literals", "type"}
        if unknown:
            raise NotImplementedError(f"secretGenerator fields {sorted(unknown)}")
        keys = [f.split("=", 1)[0] if "=" in f else os.path.basename(f) for f in g.get("files", [])]
        keys += [lit.split("=", 1)[0] for lit in g.get("literals", [])]
        out.append({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": g["name"]},
                    "type": g.get("type", "Opaque"), "data": {key: "<generated>" for key in keys}})
    for p in k.get("patches", []):
        if set(p) != {"path"}:
            raise NotImplementedError(f"patch fields {sorted(p)} (only path)")
        for patch in _load_docs(os.path.join(directory, p["path"])):
            targets = [i for i, o in enumerate(out) if o["kind"] == patch["kind"]
                       and o["metadata"]["name"] == patch["metadata"]["name"]]
            assert len(targets) == 1, f"patch {p['path']} matches {len(targets)} resources"
            out[targets[0]] = _smp(out[targets[0]], patch)
    for img in k.get("images", []):
        for o in out:
            for c in _pod_containers(o):
                name, _, tag = c["image"].partition(":")
                if name == img["name"]:
                    c["image"] = f"{img.get('newName', name)}:{img.get('newTag', tag)}"
    return out


def same_default(doc, code):
    """Whether a default as a table documents it (`(empty)`, a number, a
    word) is the flag's default in the code."""
    if doc == "(empty)":
        return code == ""
    try:
        return float(doc) == float(code)
    except ValueError:
        return doc == code
