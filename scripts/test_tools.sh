#!/usr/bin/env bash
# The tools some tests drive that are not Python packages (scripts/test.sh runs this; the
# demo needs neither): Debian's chromium, a real browser for the feature site's tests
# (tests/test_features_site.py), and Azurite from npm, the Azure blob emulator for the az://
# tests, into .emulators/ (gitignored). fake-gcs-server (gs://) comes with the dev extra.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
  echo "test tools: chromium from Debian (the feature site's tests render it in a real browser)" >&2
  SUDO=$([ "$(id -u)" = 0 ] && echo "" || echo "sudo")
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq chromium >/dev/null
fi
if [ ! -x .emulators/node_modules/.bin/azurite-blob ]; then
  command -v npm >/dev/null 2>&1 || { echo "test tools: npm is needed for Azurite (the az:// tests): install node.js" >&2; exit 1; }
  echo "test tools: azurite 3.35.0 from npm into .emulators/ (the az:// tests' emulator)" >&2
  npm install --prefix .emulators --no-audit --no-fund --silent "azurite@3.35.0" >/dev/null
fi
