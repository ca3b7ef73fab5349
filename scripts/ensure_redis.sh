#!/usr/bin/env bash
# Make sure a redis-server binary exists (Debian's package); tests and `make run` start their own servers.
set -euo pipefail
if command -v redis-server >/dev/null 2>&1; then exit 0; fi
if [ "$(id -u)" -ne 0 ]; then
  echo "redis-server is not installed; run: sudo apt-get install -y redis-server" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -q >/dev/null
apt-get install -y -q redis-server >/dev/null
# the package starts a system service; our tests start their own servers on free ports
(service redis-server stop || true) >/dev/null 2>&1
command -v redis-server >/dev/null
