#!/usr/bin/env bash
# Render a normswap report in headless Chromium and save a PNG screenshot of it.
#   scripts/screenshot_report.sh REPORT_DIR_OR_HTML [OUT.png] [WIDTHxHEIGHT]
# Needs chromium (Debian: apt-get install -y chromium). Not used by the tests or CI: it is how a
# person checks that report.html really renders (fonts, CSS, embedded base64 figures).
set -euo pipefail

src=${1:?usage: $0 REPORT_DIR_OR_HTML [OUT.png] [WIDTHxHEIGHT]}
out=${2:-report-screenshot.png}
size=${3:-1200x2400}
[[ -d "$src" ]] && src="$src/report.html"
[[ -f "$src" ]] || { echo "no such report: $src" >&2; exit 2; }

browser=""
for b in chromium chromium-browser google-chrome google-chrome-stable; do
    if command -v "$b" >/dev/null 2>&1; then browser=$b; break; fi
done
[[ -n "$browser" ]] || { echo "no chromium/chrome found (apt-get install -y chromium)" >&2; exit 2; }

profile=$(mktemp -d)
trap 'rm -rf "$profile"' EXIT
abs_src=$(cd "$(dirname "$src")" && pwd)/$(basename "$src")
case "$out" in /*) abs_out=$out ;; *) abs_out=$(pwd)/$out ;; esac

# The report is self-contained, so no network is needed (and none is allowed to be used).
"$browser" --headless --no-sandbox --disable-gpu --disable-background-networking \
    --disable-component-update --disable-sync --no-first-run --hide-scrollbars \
    --user-data-dir="$profile" --window-size="${size/x/,}" \
    --screenshot="$abs_out" "file://$abs_src" >/dev/null 2>&1
[[ -s "$abs_out" ]] || { echo "chromium wrote no screenshot" >&2; exit 1; }
echo "$abs_out"
