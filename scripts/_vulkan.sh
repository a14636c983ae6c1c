# Sourced by scripts/test only (never by scripts/demo or scripts/bench), after scripts/_machine.sh
# (its consent and apt-get helpers): the device tests
# (tests/processes/test_stage_device.py) run stages on a real non-host ggml backend, Vulkan on Mesa's
# lavapipe (a software Vulkan device on the CPU). They need llama-cpp-python 0.3.36 built with
# -DGGML_VULKAN=on instead of the CPU-only build scripts/_setup.sh installs, and, to build it,
# machine packages: glslc spirv-headers libvulkan-dev mesa-vulkan-drivers vulkan-tools cmake.
# Those are installed with apt-get as root without asking only in CI (CI=true, where a skipped
# device test fails the run) or with SKIPPY_INSTALL_VULKAN=1; on a terminal scripts/test asks
# first; otherwise it says what it did not install and the device tests skip.
# SKIPPY_INSTALL_VULKAN=0 never installs. The wheel is built once (10-25 min on 2 cores) into
# .work/wheels/vulkan and reinstalled from there: pip's own wheel cache keys on the source
# archive, not on CMAKE_ARGS, so it is bypassed (--no-cache-dir) and a CPU wheel never stands in
# for the Vulkan one, or the other way round. The Vulkan build in CPU mode computes the same
# bits as the CPU-only one, so every other test runs on it unchanged.
VULKAN_PACKAGES="glslc spirv-headers libvulkan-dev mesa-vulkan-drivers vulkan-tools cmake"
# Debian 12's Vulkan headers are too old for this llama.cpp ('LayerSettingEXT' is not a member
# of 'vk'); Debian 13's libvulkan-dev 1.4.309 headers work, unpacked without installing them.
VULKAN_HEADERS_DEB="libvulkan-dev"
VULKAN_HEADERS_SUITE="trixie"

_vulkan_installed() {  # the venv's llama-cpp-python was built with Vulkan
  "$PY" -c 'import sys; from skippy.gguf.ggml import library_dir
sys.exit(0 if (library_dir() / "libggml-vulkan.so").exists() else 1)' 2>/dev/null
}

# Debian 13's Vulkan headers under $1 (an include dir path is printed), when the system's are
# older than 1.4.
_vulkan_headers() {
  local dir="$1"
  if [ "$(cut -d. -f1 /etc/debian_version 2>/dev/null || echo 0)" -ge 13 ] 2>/dev/null; then
    return 0  # the system's own headers are new enough
  fi
  if [ -f "$dir/usr/include/vulkan/vulkan.hpp" ]; then
    echo "$dir/usr/include"; return 0
  fi
  local list tmp
  list="$(mktemp)"
  tmp="$(mktemp -d)"
  # A source list for the download only, passed to apt-get and removed: nothing is installed
  # from it and the system's own lists are left as they were.
  echo "deb http://deb.debian.org/debian $VULKAN_HEADERS_SUITE main" > "$list"
  local only=(-o Dir::Etc::sourcelist="$list" -o Dir::Etc::sourceparts=-
    -o Dir::State::lists="$tmp/lists" -o Dir::Cache="$tmp/cache")
  mkdir -p "$tmp/lists/partial" "$tmp/cache/archives/partial"
  apt-get "${only[@]}" update -qq >/dev/null &&
    (cd "$tmp" && apt-get "${only[@]}" download -qq "$VULKAN_HEADERS_DEB" >/dev/null) ||
    { rm -rf "$tmp" "$list"; return 1; }
  rm -f "$list"
  mkdir -p "$dir"
  dpkg -x "$tmp"/"$VULKAN_HEADERS_DEB"_*.deb "$dir"
  rm -rf "$tmp"
  echo "$dir/usr/include"
}

ensure_vulkan_build() {
  if _vulkan_installed; then
    return 0
  fi
  local wheels="$WORK/wheels/vulkan" wheel
  wheel="$(ls "$wheels"/llama_cpp_python-0.3.36-*.whl 2>/dev/null | head -1 || true)"
  if [ -z "$wheel" ]; then
    local sudo_
    if ! sudo_="$(machine_sudo)"; then
      _machine_note "warning: no root to install $VULKAN_PACKAGES: the device tests will skip"
      return 0
    fi
    local what="the device tests (a Vulkan build of llama-cpp-python, 10-25 minutes once)"
    machine_consent "$what" SKIPPY_INSTALL_VULKAN "$VULKAN_PACKAGES" || return 0
    local log="$VENV/vulkan-build.log" include
    : > "$log"
    machine_apt "$sudo_" "$VULKAN_PACKAGES" "$log" || { _machine_note "warning: apt-get failed" \
      "(see $log): the device tests will skip"; return 0; }
    include="$(_vulkan_headers "$WORK/vulkan" 2>>"$log")" || {
      _machine_note "warning: no Vulkan 1.4 headers (see $log): the device tests will skip"
      return 0; }
    local args="-DGGML_VULKAN=on -DGGML_NATIVE=OFF"
    [ -n "$include" ] && args="$args -DVulkan_INCLUDE_DIR=$include"
    _machine_note "==> building llama-cpp-python 0.3.36 with Vulkan into $wheels (once)"
    mkdir -p "$wheels"
    CMAKE_ARGS="$args" "$PY" -m pip wheel -q --no-deps --no-cache-dir -w "$wheels" \
      "llama-cpp-python==0.3.36" >>"$log" 2>&1 ||
      { _machine_note "warning: the Vulkan build failed (see $log): the device tests will skip"
        return 0; }
    wheel="$(ls "$wheels"/llama_cpp_python-0.3.36-*.whl | head -1)"
  fi
  _machine_note "==> installing $wheel (Vulkan) into $VENV"
  "$PY" -m pip install -q --no-deps --force-reinstall "$wheel" >>"$VENV/install.log" 2>&1
}
