"""Functions of 50 or more lines in plexd/, longest first: `python3 scripts/long_functions.py . [N]` (N: how many to list)."""

import ast, pathlib, sys
root = pathlib.Path(sys.argv[1])
long = []
for p in sorted((root / "plexd").rglob("*.py")):
    t = ast.parse(p.read_text())
    for n in ast.walk(t):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
            ln = n.end_lineno - n.lineno + 1
            if ln >= 50:
                long.append((ln, str(p.relative_to(root)), n.name))
print(len(long), "functions of 50+ lines;", sum(1 for l in long if "devplane" not in l[1]), "outside plexd/devplane")
for l in sorted(long, reverse=True)[: int(sys.argv[2]) if len(sys.argv) > 2 else 0]:
    print(*l)
