#!/bin/sh
# pip inside an image build: `deps EXTRA` installs the extra's pinned dependencies into the image's
# virtual environment (/opt/pdfabric), `project EXTRA` the pdfabric distribution itself (no deps)
# and drops what the image does not run. The host's pip configuration comes in as the pip-conf and
# pip-cert secrets (hack/images.sh); without them pip uses its defaults.
set -eu
what=$1 extra=$2
venv=/opt/pdfabric
if [ -s /run/secrets/pip-conf ]; then export PIP_CONFIG_FILE=/run/secrets/pip-conf; fi
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_PROGRESS_BAR=off PIP_ROOT_USER_ACTION=ignore
if [ ! -x "$venv/bin/python" ]; then python3 -m venv "$venv"; fi
pip="$venv/bin/python -m pip"
case "$what" in
  deps)
    python3 /src/images/requirements.py /src/pyproject.toml "$extra" > /tmp/requirements.txt
    $pip install -q -r /tmp/requirements.txt
    # The agents' NIXL (backend: nixl) without its declared dependencies: both CUDA variants and
    # torch, none of which it needs to import (images/nixl-nodeps.txt says why).
    case "$extra" in
      agent*) $pip install -q --no-deps -r /src/images/nixl-nodeps.txt ;;
    esac
    ;;
  project)
    $pip install -q --no-deps /src
    site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    # Each image holds the packages it runs: the operator no agent, the agents no operator.
    case "$extra" in
      operator) rm -rf "$site/pdfabric_agent" "$site/pdfabric_sglang" "$venv/bin/pdfabric-agent" ;;
      agent*) rm -rf "$site/pdfabric_operator" "$site/pdfabric_sglang" "$venv/bin/pdfabric-operator" ;;
    esac
    # The Kubernetes client is the operator image's largest part (some 2,000 generated modules):
    # its byte code only, compiled next to where the sources were (half the size, and no compile
    # at each start on a read-only root filesystem); tracebacks there show no source lines.
    if [ -d "$site/kubernetes" ]; then
      "$venv/bin/python" -m compileall -q -b -j 0 "$site/kubernetes"
      find "$site/kubernetes" -name '*.py' -delete
      find "$site/kubernetes" -name __pycache__ -type d -prune -exec rm -rf {} +
    fi
    # Nothing installs at run time: no pip, no setuptools, no tests shipped by dependencies.
    $pip uninstall -q -y pip setuptools 2>/dev/null || true
    rm -rf "$venv/bin/pip"* "$venv/bin/activate"* "$venv/bin/Activate.ps1" "$venv/share"
    find "$venv" -depth \( -name tests -o -name test \) -path '*/site-packages/*' -type d -prune \
      -exec rm -rf {} + 2>/dev/null || true
    ;;
  *) echo "usage: pip-install.sh deps|project EXTRA" >&2; exit 2 ;;
esac
