#!/usr/bin/env bash
# Does the wheel work on its own? Build qkv's sdist and wheel (the wheel from the sdist, so the sdist is
# checked too), install the wheel (not editable) in a fresh venv that sees no other site-packages, and
# use it from a folder outside the checkout, where the checkout's src/ cannot be imported: --version,
# the recipes, a 5-step training run, a translation, and the explorer page (which needs the package's
# static files). Run by .ci/run; on its own: `bash .ci/wheel_smoke.sh` with `build` installed
# (pip install -e ".[dev]"). QKV_SMOKE_KEEP=1 keeps the temporary folder for a look afterwards.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
python="${PYTHON:-python3}"
work="$(mktemp -d "${TMPDIR:-/tmp}/qkv-wheel-smoke.XXXXXX")"
if [ "${QKV_SMOKE_KEEP:-0}" = 1 ]; then
    echo "wheel smoke: keeping $work"
else
    trap 'rm -rf "$work"' EXIT
fi
step() { echo "wheel smoke [${SECONDS}s]: $*"; }

# 1. Build from a copy of the working tree (tracked and untracked files that git does not ignore), so the
# build's own files (src/qkv.egg-info, build/) never land in the checkout.
step "copying the working tree"
mkdir -p "$work/tree"
git -C "$repo" ls-files -z --cached --others --exclude-standard \
    | tar -C "$repo" --null --files-from=- --ignore-failed-read -cf - \
    | tar -C "$work/tree" -xf -
step "building the sdist and the wheel"
"$python" -m build --outdir "$work/dist" "$work/tree" >"$work/build.log" 2>&1 \
    || { tail -40 "$work/build.log"; echo "wheel smoke: the build failed" >&2; exit 1; }
wheels=("$work"/dist/qkv-*.whl)
sdists=("$work"/dist/qkv-*.tar.gz)
[ -f "${wheels[0]}" ] && [ -f "${sdists[0]}" ] || { ls -l "$work/dist"; echo "wheel smoke: no wheel or sdist" >&2; exit 1; }
wheel="${wheels[0]}"
version="$(basename "$wheel" | cut -d- -f2)"
step "built $(basename "$wheel") and $(basename "${sdists[0]}")"

# 2. The wheel holds every file that must ship beside the code: the same names as the source tree.
"$python" - "$wheel" "$repo/src/qkv" <<'EOF'
import sys, zipfile
from pathlib import Path

wheel, src = sys.argv[1], Path(sys.argv[2])
names = set(zipfile.ZipFile(wheel).namelist())
wanted = {
    "the explorer's static files": sorted(p for p in (src / "viz" / "static").iterdir() if p.is_file()),
    "the recipes": sorted((src / "runs" / "recipes").glob("*.toml")),
    "py.typed": [src / "py.typed"],
}
bad = False
for what, files in wanted.items():
    inside = ["qkv/" + p.relative_to(src).as_posix() for p in files]
    missing = [n for n in inside if n not in names]
    if not files or missing:
        bad = True
        print(f"wheel smoke: {what}: {'none in the source tree' if not files else 'not in the wheel: ' + ', '.join(missing)}")
    else:
        print(f"wheel smoke: {what}: all {len(files)} in the wheel")
sys.exit(1 if bad else 0)
EOF

# 3. A fresh venv (no --system-site-packages): torch first, as .ci/run does, then the wheel itself.
step "making a fresh venv"
"$python" -m venv "$work/venv"
venv_python="$work/venv/bin/python"
"$venv_python" -m pip install -q --upgrade pip
step "installing torch==2.13.0"
"$venv_python" -m pip install -q --retries 1 --timeout 10 --index-url https://download.pytorch.org/whl/cpu torch==2.13.0 \
    || "$venv_python" -m pip install -q torch==2.13.0
step "installing the wheel"
"$venv_python" -m pip install -q "$wheel"
qkv="$work/venv/bin/qkv"

# 4. Use it from outside the checkout.
mkdir -p "$work/outside"
cd "$work/outside"
export PYTHONNOUSERSITE=1 PYTHONSAFEPATH=1
unset PYTHONPATH
step "qkv --version"
got="$("$qkv" --version)"
echo "$got"
[ "$got" = "qkv $version" ] || { echo "wheel smoke: qkv --version said '$got', the wheel is $version" >&2; exit 1; }

step "the installed package and its static files"
"$venv_python" - "$work/venv" <<'EOF'
import importlib.metadata, importlib.resources as r, sys
from pathlib import Path

import qkv

where = Path(qkv.__file__).resolve()
assert Path(sys.argv[1]).resolve() in where.parents, f"qkv imported from {where}, not from the venv"
assert importlib.metadata.version("qkv") == qkv.__version__, (importlib.metadata.version("qkv"), qkv.__version__)
static = r.files("qkv.viz").joinpath("static")
names = sorted(p.name for p in static.iterdir())
print(static)
print(" ".join(names))
assert "explorer.html" in names, names
EOF

step "qkv recipes"
"$qkv" recipes

step "qkv train --data dates --max-steps 5"
"$qkv" train --data dates --max-steps 5 --run-dir "$work/run" --no-progress --threads 1

step "qkv translate"
out="$(echo "March 3, 2021" | "$qkv" translate "$work/run" --threads 1)"
echo "translation after 5 steps: '$out'"
[ "$(printf '%s\n' "$out" | wc -l)" -eq 1 ] || { echo "wheel smoke: expected one line from qkv translate" >&2; exit 1; }

step "qkv attend (the explorer page, built from the package's static files)"
"$qkv" attend --model "$work/run" "March 3, 2021" -o "$work/page.html"
"$venv_python" - "$work/page.html" <<'EOF'
import importlib.resources as r, sys

page = open(sys.argv[1], encoding="utf-8").read()
# every static file is inlined into the page: its longest line must be there
for f in r.files("qkv.viz").joinpath("static").iterdir():
    longest = max(f.read_text(encoding="utf-8").splitlines(), key=len).strip()
    assert longest in page, f"{f.name} is not in the page"
print(f"the page ({len(page)} characters) inlines every static file")
EOF

step "passed: qkv $version from its wheel"
