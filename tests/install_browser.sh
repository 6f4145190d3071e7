#!/usr/bin/env bash
# The browser tests (tests/serve/test_webpage.py) drive headless Chromium through chromedriver. Where either is
# missing and Debian's apt can install them (as root, or with password-less sudo), install both; otherwise say so
# and go on: the browser tests then skip, naming what is missing.
set -uo pipefail
if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then
    exit 0
fi
if ! command -v apt-get >/dev/null; then
    echo "install_browser: no chromium / chromedriver and no apt-get: the browser tests will skip"
    exit 0
fi
if [ "$(id -u)" -eq 0 ]; then sudo=""; elif sudo -n true 2>/dev/null; then sudo="sudo -n"; else
    echo "install_browser: no chromium / chromedriver and no root to install them: the browser tests will skip"
    exit 0
fi
echo "install_browser: installing Debian's chromium and chromium-driver for the browser tests"
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get install -y -q chromium chromium-driver >/dev/null 2>&1 \
    || { $sudo apt-get update -q >/dev/null 2>&1 && $sudo apt-get install -y -q chromium chromium-driver >/dev/null 2>&1; } \
    || echo "install_browser: apt-get could not install chromium chromium-driver: the browser tests will skip"
exit 0
