#!/usr/bin/env python3
"""Every relative link in README.md, CHANGELOG.md and docs/*.md points at a file
that exists, and every #anchor at a heading of its page; docs/ holds no dated
measurement files (they live in docs/measurements/, one current file per
benchmark, and git keeps the history).

Usage: python3 tests/docs_links_test.py [ROOT]   (exit 1 naming each broken link)
"""
import os
import re
import sys

root = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..")
pages = ["README.md", "CHANGELOG.md"] + [os.path.join("docs", f) for f in sorted(os.listdir(os.path.join(root, "docs")))
                                       if f.endswith(".md")]


def anchors(path):
    """GitHub's anchors for the headings of a Markdown file."""
    out, fenced = set(), False
    for line in open(path, encoding="utf-8"):
        if line.startswith("```"):
            fenced = not fenced
        m = None if fenced else re.match(r"#{1,6} (.*)", line)
        if m:
            text = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower().replace("`", ""))
            out.add(text.replace(" ", "-"))
    return out


broken = []
for page in pages:
    path = os.path.join(root, page)
    if not os.path.exists(path):
        broken.append(f"{page}: missing")
        continue
    text = re.sub(r"```.*?```", "", open(path, encoding="utf-8").read(), flags=re.S)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        dest = os.path.normpath(os.path.join(os.path.dirname(path), file)) if file else path
        if not os.path.exists(dest):
            broken.append(f"{page}: {target}: no such file")
        elif anchor and dest.endswith(".md") and anchor not in anchors(dest):
            broken.append(f"{page}: {target}: no such heading")
dated = [f for f in os.listdir(os.path.join(root, "docs")) if re.search(r"_\d{4}-\d\d-\d\d", f)]
broken += [f"docs/{f}: a dated measurement outside docs/measurements/" for f in dated]
for line in broken:
    print(line)
print(f"{len(pages)} pages checked, {len(broken)} problems")
sys.exit(1 if broken else 0)
