# Sourced by scripts/test only (never by scripts/demo or scripts/bench): the status page's
# real-browser test (tests/test_status_page_browser.py) drives Debian's chromium through
# chromedriver. They are machine packages, installed with apt-get as root, so they are
# installed without asking only in CI (CI=true, where a skipped test fails the run) or when
# SKIPPY_INSTALL_BROWSER=1; on a terminal scripts/test asks first; otherwise it says what
# it did not install and the browser test skips. SKIPPY_INSTALL_BROWSER=0 never installs.
BROWSER_PACKAGES="chromium chromium-driver"

_browser_note() { echo "$*" >&2; }

# Whether to run apt-get now (0: yes). Tells the user what would be installed, first.
_browser_consent() {
  local ci="${CI:-}" want="${SKIPPY_INSTALL_BROWSER:-}"
  _browser_note "==> the browser test needs Debian's $BROWSER_PACKAGES (missing here):" \
    "apt-get installs them system-wide, with their dependencies (over a hundred packages" \
    "on a minimal Debian)"
  case "$want" in
    1) return 0 ;;
    0) _browser_note "    not installed (SKIPPY_INSTALL_BROWSER=0): the browser test will skip"
       return 1 ;;
  esac
  case "${ci,,}" in
    1 | true | yes) _browser_note "    installing them (CI=$ci)"; return 0 ;;
  esac
  if [ -t 0 ] && [ -t 2 ]; then
    local answer=""
    read -r -p "    install them now with apt-get? [y/N] " answer || answer=""
    case "${answer,,}" in
      y | yes) return 0 ;;
    esac
  fi
  _browser_note "    not installed: the browser test will skip (SKIPPY_INSTALL_BROWSER=1" \
    "scripts/test installs them)"
  return 1
}

ensure_test_browser() {
  if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then
    return 0
  fi
  local sudo_=""
  if [ "$(id -u)" != 0 ]; then
    if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
      sudo_="sudo -n"
    else
      _browser_note "warning: chromium/chromedriver missing and no root to install them" \
        "($BROWSER_PACKAGES): the browser test will skip"
      return 0
    fi
  fi
  _browser_consent || return 0
  local log="${VENV:-.}/apt.log"
  # shellcheck disable=SC2086  # the package list is split on purpose
  { $sudo_ apt-get update -qq &&
    DEBIAN_FRONTEND=noninteractive $sudo_ apt-get install -y -qq $BROWSER_PACKAGES
  } >"$log" 2>&1 ||
    _browser_note "warning: apt-get could not install $BROWSER_PACKAGES (see $log): the" \
      "browser test will skip"
}
