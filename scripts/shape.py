#!/usr/bin/env python3
"""The shape #53 measures: files over 800 lines in src/ and tools/, and
functions over 80 lines (a definition at column 0 to its closing brace; a
constructor's initializer list counts from its first line).

Usage: python3 scripts/shape.py [ROOT]   (ROOT: the repository, default .)
"""
import glob
import os
import re
import sys

root = sys.argv[1] if len(sys.argv) > 1 else "."
files = sorted(glob.glob(os.path.join(root, "src", "*.cpp")) + glob.glob(os.path.join(root, "src", "*.h")) +
               glob.glob(os.path.join(root, "tools", "*.cpp")) + glob.glob(os.path.join(root, "tools", "*.h")))
start = re.compile(r"^[A-Za-z][^;]*\(")  # a definition's first line: a name and its parameters
long_files, long_functions = [], []
for path in files:
    lines = open(path, encoding="utf-8").read().split("\n")
    name = os.path.relpath(path, root)
    if len(lines) - 1 > 800:
        long_files.append(f"{name}: {len(lines) - 1} lines")
    i = 0
    while i < len(lines):
        line = lines[i]
        if start.match(line) and not line.startswith(("namespace", "struct", "class", "enum", "using", "template")):
            # Find the body's opening brace, then its matching close.
            j, depth, opened = i, 0, False
            while j < len(lines):
                depth += lines[j].count("{") - lines[j].count("}")
                opened = opened or "{" in lines[j]
                if lines[j].rstrip().endswith(";") and not opened:
                    break  # a declaration
                if opened and depth <= 0:
                    break
                j += 1
            if opened and j - i + 1 > 80:
                long_functions.append(f"{name}:{i + 1}: {j - i + 1} lines: {line.strip()[:70]}")
            i = j + 1
        else:
            i += 1
print(f"files over 800 lines: {len(long_files)}")
print("\n".join("  " + f for f in long_files))
print(f"functions over 80 lines: {len(long_functions)}")
print("\n".join("  " + f for f in long_functions))
