#!/usr/bin/env bash
# Install a headless Chromium for tests/test_viewer.py (Debian/Ubuntu, root); no-op when one is
# on PATH. The test drives it with playwright (a dev extra) and skips, saying why, without one.
set -euo pipefail
for b in chromium-headless-shell chromium google-chrome; do
    command -v "$b" >/dev/null && { echo "chromium: $(command -v "$b")"; exit 0; }
done
[ "$(id -u)" = 0 ] || { echo "chromium: not installed and not root; tests/test_viewer.py will skip" >&2; exit 0; }
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends chromium-headless-shell fonts-dejavu-core >/dev/null
echo "chromium: $(command -v chromium-headless-shell)"
