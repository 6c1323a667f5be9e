#!/usr/bin/env bash
# Headless Chromium and its WebDriver from Debian for the report's browser test (nox -s report); run as root.
set -euo pipefail
if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; then
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -q
apt-get install -y -q --no-install-recommends chromium chromium-driver
