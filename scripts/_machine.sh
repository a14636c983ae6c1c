# Sourced by scripts/test only (never by scripts/demo or scripts/bench): machine packages some
# tests need, installed with apt-get as root. They are installed without asking only in CI
# (CI=true, where a skipped test fails the run) or when the purpose's switch is 1
# (SKIPPY_INSTALL_BROWSER=1, ...); on a terminal scripts/test asks first; otherwise it says
# what it did not install and those tests skip. A switch set to 0 never installs.

_machine_note() { echo "$*" >&2; }

# machine_consent WHAT SWITCH PACKAGES: whether to install PACKAGES for WHAT now (0: yes),
# telling the user what would be installed first.
machine_consent() {
  local what="$1" switch="$2" packages="$3" ci="${CI:-}" want
  want="${!switch:-}"
  _machine_note "==> $what: needs Debian's $packages (missing here); apt-get installs them" \
    "system-wide, with their dependencies"
  case "$want" in
    1) return 0 ;;
    0) _machine_note "    not installed ($switch=0): $what will skip"
       return 1 ;;
  esac
  case "${ci,,}" in
    1 | true | yes) _machine_note "    installing them (CI=$ci)"; return 0 ;;
  esac
  if [ -t 0 ] && [ -t 2 ]; then
    local answer=""
    read -r -p "    install them now with apt-get? [y/N] " answer || answer=""
    case "${answer,,}" in
      y | yes) return 0 ;;
    esac
  fi
  _machine_note "    not installed: $what will skip ($switch=1 scripts/test installs them)"
  return 1
}

# machine_sudo: the prefix apt-get needs here on stdout ("" as root, else a password-less
# "sudo -n"); fails when neither is at hand.
machine_sudo() {
  if [ "$(id -u)" = 0 ]; then
    echo ""
  elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    echo "sudo -n"
  else
    return 1
  fi
}

# machine_apt SUDO PACKAGES LOG: apt-get install PACKAGES (its output appended to LOG).
machine_apt() {
  local sudo_="$1" packages="$2" log="$3"
  # shellcheck disable=SC2086  # the prefix and the package list are split on purpose
  { $sudo_ apt-get update -qq &&
    DEBIAN_FRONTEND=noninteractive $sudo_ apt-get install -y -qq $packages
  } >>"$log" 2>&1
}

# machine_install WHAT SWITCH PACKAGES: apt-get install PACKAGES when consented (as root, or
# through a password-less sudo); a failure is a warning and the tests that need them skip.
machine_install() {
  local what="$1" switch="$2" packages="$3" sudo_
  if ! sudo_="$(machine_sudo)"; then
    _machine_note "warning: $packages missing and no root to install them: $what will skip"
    return 0
  fi
  machine_consent "$what" "$switch" "$packages" || return 0
  local log="${VENV:-.}/apt.log"
  machine_apt "$sudo_" "$packages" "$log" ||
    _machine_note "warning: apt-get could not install $packages (see $log): $what will skip"
}

# The status page's real-browser test (tests/processes/test_status_page_browser.py) drives Debian's
# chromium through chromedriver.
ensure_test_browser() {
  if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then
    return 0
  fi
  machine_install "the browser test" SKIPPY_INSTALL_BROWSER "chromium chromium-driver"
}

# The NAT lab's tests (tests/mesh_node/lab/test_nat_lab.py) put nodes behind kernel NAT in network
# namespaces: nftables' masquerade.
ensure_nftables() {
  command -v nft >/dev/null 2>&1 && return 0
  machine_install "the NAT lab tests" SKIPPY_INSTALL_NFTABLES "nftables"
}
