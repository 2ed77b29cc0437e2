# Hand-run mutants of csrc/overlap.h that survived the mutation run before the overlap-words test.
# From the repository root: cp cupy_rope/csrc/overlap.h /tmp/overlap.h.orig; python this file
import re, subprocess, sys, shutil
from pathlib import Path
src = Path("cupy_rope/csrc/overlap.h"); orig = Path("/tmp/overlap.h.orig").read_text()
lines = orig.splitlines()
def find(sub):
    return next(i for i, l in enumerate(lines) if sub in l)
i29 = find("return a.lo < a.hi")
mutants = []
l = lines[i29]
for m in re.finditer(" < ", l):
    mutants.append((i29, l[:m.start()] + " <= " + l[m.end():]))
i44 = find("key.push_back(both);")
mutants.append((i44, ""))
i43 = find("const bool both")
mutants.append((i43, lines[i43].replace("n >= 2", "n > 2")))
mutants.append((i43, lines[i43].replace("n >= 2", "n >= 1")))
for i, new in mutants:
    ls = list(lines); ls[i] = new
    src.write_text("\n".join(ls) + "\n")
    r = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "tests/test_launch_cache.py",
                        "-k", "overlap_words or cpp_keys"], capture_output=True, text=True)
    print("killed  " if r.returncode else "SURVIVED", i + 1, new.strip()[:90])
src.write_text(orig)
