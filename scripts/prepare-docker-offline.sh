#!/usr/bin/env bash
# Prepare a machine without registry access (or without the PyTorch index) to build and run the
# docker-compose stack. Idempotent: each step checks first and says what it did.
#
#   scripts/prepare-docker-offline.sh [--install] [--no-build] [--base-image IMAGE]
#                                     [--platform linux/arm64] [--quiet]
#
#   --platform linux/arm64 prepares the same image for an arm64 board (Raspberry Pi 4/5, Jetson)
#   and, on an x86 machine, builds it under emulation: qemu-user-static's binfmt handler must be
#   registered (--install installs qemu-user-static and binfmt-support). The base image is then
#   fedcybgd-base:bookworm-arm64, torch the CPU index's aarch64 build (without the index: PyPI's
#   aarch64 wheel, a CUDA build that runs on the CPU too but adds ~3.5 GB), the build arguments
#   docker-extra/build-arm64.env and the image fedcybgd:0.1.0-arm64. qemu older than 8 crashes in
#   torch's aarch64 kernels: Debian 13's static qemu-aarch64 is unpacked and registered instead.
#   On an arm64 machine the same command builds natively.
#
#   1. Docker engine: `docker info` answers, else start the installed `dockerd` (as root; log in
#      $DOCKERD_LOG). --install first apt-get installs docker.io, docker-compose and debootstrap
#      when they are missing (Debian/Ubuntu, as root).
#   2. Base image: python:3.11-slim when it is present or can be pulled; else a local
#      `fedcybgd-base:bookworm` (debootstrap --variant=minbase bookworm + python3, python3-venv,
#      ca-certificates; `docker import`), made once and kept.
#   3. torch: the CPU index (https://download.pytorch.org/whl/cpu) when it answers; else a torch
#      CPU wheel (a `+cpu` build, cp311, manylinux x86_64) that the host's pip can get (a local
#      find-links folder, a mirror), copied into docker-extra/wheels/.
#   4. Extra CA certificates: when the host's pip is configured with its own CA bundle (a TLS-
#      inspecting proxy), that bundle is copied to docker-extra/ca-certificates.pem for pip.
#   5. Writes the build arguments to docker-extra/build.env (FEDCYBGD_* variables that the
#      compose files pass to the Dockerfile) and, unless --no-build, runs
#      `docker-compose --env-file docker-extra/build.env build`.
#
# Afterwards: docker-compose --env-file docker-extra/build.env build   (or: make compose-build)
# On a machine with registry and index access nothing of this is needed: the Dockerfile's
# defaults are right, `docker-compose build` works as it is.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
EXTRA="$ROOT/docker-extra"
DEFAULT_BASE="python:3.11-slim"
DEBIAN_MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
QEMU_DIR="${FEDCYBGD_QEMU_DIR:-/usr/local/lib/fedcybgd-qemu}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
TORCH_INDEX="https://download.pytorch.org/whl/cpu"
DOCKERD_LOG="${DOCKERD_LOG:-/var/log/fedcybgd-dockerd.log}"
PULL_TIMEOUT="${PULL_TIMEOUT:-60}"

install=0 build=1 base_image="" quiet=0 platform=""
while [ $# -gt 0 ]; do
    case "$1" in
        --install) install=1 ;;
        --no-build) build=0 ;;
        --base-image) base_image="$2"; shift ;;
        --platform) platform="$2"; shift ;;
        --quiet) quiet=1 ;;
        -h|--help) sed -n '2,34p' "$0"; exit 0 ;;
        *) echo "unknown option: $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done

say() { echo "[prepare-docker] $*"; }
fail() { echo "[prepare-docker] ERROR: $*" >&2; exit 1; }
is_root() { [ "$(id -u)" = 0 ]; }

# The platform decides every name: Debian's architecture, the base image, the build arguments'
# file, the image tag and the pip platform of the torch wheel.
native="$(uname -m)"
case "${platform:-native}" in
    native|linux/amd64) arch=amd64 ;;
    linux/arm64|linux/arm64/v8|linux/aarch64) arch=arm64 ;;
    *) fail "--platform $platform: linux/amd64 or linux/arm64" ;;
esac
[ -n "$platform" ] || case "$native" in aarch64|arm64) arch=arm64 ;; esac
case "$native" in x86_64|amd64) native_arch=amd64 ;; aarch64|arm64) native_arch=arm64 ;; *) native_arch="$native" ;; esac
if [ "$arch" = amd64 ]; then
    ENV_FILE="$EXTRA/build.env" LOCAL_BASE="${FEDCYBGD_LOCAL_BASE:-fedcybgd-base:bookworm}"
    IMAGE="fedcybgd:0.1.0" WHEEL_PLATFORM=manylinux_2_28_x86_64
else
    ENV_FILE="$EXTRA/build-arm64.env" LOCAL_BASE="${FEDCYBGD_LOCAL_BASE:-fedcybgd-base:bookworm-arm64}"
    IMAGE="fedcybgd:0.1.0-arm64" WHEEL_PLATFORM=manylinux_2_28_aarch64
fi
foreign=0
[ "$arch" = "$native_arch" ] || foreign=1

# -- 1. engine ---------------------------------------------------------------------------------
if [ "$install" = 1 ]; then
    missing=()
    command -v dockerd >/dev/null 2>&1 || missing+=(docker.io)
    command -v docker-compose >/dev/null 2>&1 || missing+=(docker-compose)
    command -v debootstrap >/dev/null 2>&1 || missing+=(debootstrap)
    if [ "$foreign" = 1 ]; then
        command -v qemu-aarch64-static >/dev/null 2>&1 || missing+=(qemu-user-static)
        command -v update-binfmts >/dev/null 2>&1 || missing+=(binfmt-support)
    fi
    if [ ${#missing[@]} -eq 0 ]; then
        say "engine packages: dockerd, docker-compose and debootstrap are installed"
    else
        is_root || fail "--install needs root to apt-get install ${missing[*]}"
        command -v apt-get >/dev/null 2>&1 || fail "--install needs apt-get (Debian/Ubuntu)"
        say "installing ${missing[*]} (apt-get)"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
            "${missing[@]}" >/dev/null
    fi
fi

command -v docker >/dev/null 2>&1 || fail "no docker CLI (apt-get install docker.io, or --install)"
if docker info >/dev/null 2>&1; then
    say "engine: dockerd is running"
else
    command -v dockerd >/dev/null 2>&1 \
        || fail "the Docker engine is not running and dockerd is not installed (--install)"
    is_root || fail "the Docker engine is not running; starting dockerd needs root"
    if [ -S /var/run/docker.sock ] && pgrep -x dockerd >/dev/null 2>&1; then
        say "engine: dockerd is starting; waiting for it"
    else
        say "engine: starting dockerd (log: $DOCKERD_LOG)"
        # its own session: it outlives this script, as a service would
        setsid dockerd >>"$DOCKERD_LOG" 2>&1 </dev/null &
    fi
    for _ in $(seq 1 60); do
        docker info >/dev/null 2>&1 && break
        sleep 1
    done
    docker info >/dev/null 2>&1 \
        || fail "dockerd did not answer within 60 s; last log lines: $(tail -5 "$DOCKERD_LOG" 2>/dev/null)"
    say "engine: dockerd is up ($(docker info --format '{{.ServerVersion}}, storage {{.Driver}}'))"
fi

# -- 1b. emulation (another architecture's image on this machine) -------------------------------
if [ "$foreign" = 1 ]; then
    [ "$arch" = arm64 ] || fail "emulation is set up for arm64 images only"
    is_root || fail "running arm64 binaries here needs qemu's binfmt handler registered (root)"
    [ -e /proc/sys/fs/binfmt_misc/register ] \
        || mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc \
        || fail "cannot mount binfmt_misc"
    if ! grep -qx enabled /proc/sys/fs/binfmt_misc/qemu-aarch64 2>/dev/null; then
        command -v update-binfmts >/dev/null 2>&1 \
            || fail "no arm64 emulation: apt-get install qemu-user-static binfmt-support (or --install)"
        update-binfmts --enable qemu-aarch64 >/dev/null 2>&1 || true
    fi
    grep -qx enabled /proc/sys/fs/binfmt_misc/qemu-aarch64 2>/dev/null \
        || fail "qemu-aarch64's binfmt handler is not enabled (apt-get install qemu-user-static)"
    # F (fix binary): the kernel opens qemu once, so it runs inside containers and chroots too
    grep -q '^flags: .*F' /proc/sys/fs/binfmt_misc/qemu-aarch64 \
        || fail "qemu-aarch64's binfmt handler lacks the F flag; containers cannot use it"
    # qemu before 8 (Debian 12 has 7.2) crashes in torch's aarch64 kernels (SIGSEGV at the first
    # matmul, after "Can't open MIDR_EL1"); Debian 13's static qemu-aarch64 (10.x) runs them.
    # It is unpacked from Debian's own package into $QEMU_DIR and registered in place of the old.
    handler="$(readlink -f "$(sed -n 's/^interpreter //p' /proc/sys/fs/binfmt_misc/qemu-aarch64)")"
    major="$("$handler" --version 2>/dev/null | sed -n 's/.*version \([0-9]*\)\..*/\1/p' | head -1)"
    if [ "${major:-0}" -lt 8 ]; then
        if [ ! -x "$QEMU_DIR/usr/bin/qemu-aarch64" ]; then
            say "emulation: qemu ${major:-?} crashes torch on arm64; fetching Debian 13's qemu-user"
            command -v xz >/dev/null 2>&1 || fail "xz is needed to read Debian's package index"
            pool="$(curl -fsS "$DEBIAN_MIRROR/dists/trixie/main/binary-amd64/Packages.xz" | xz -dc \
                | awk '/^Package: qemu-user$/{p=1} p&&/^Filename:/&&!f{print $2; f=1} /^$/{p=0}')"
            [ -n "$pool" ] || fail "no qemu-user in Debian 13's index at $DEBIAN_MIRROR"
            tmp="$(mktemp -d)"
            curl -fsS -o "$tmp/qemu-user.deb" "$DEBIAN_MIRROR/$pool" \
                || fail "could not download $DEBIAN_MIRROR/$pool"
            mkdir -p "$QEMU_DIR" && dpkg-deb -x "$tmp/qemu-user.deb" "$QEMU_DIR"
            rm -rf "$tmp"
        fi
        echo -1 > /proc/sys/fs/binfmt_misc/qemu-aarch64
        printf '%s' ':qemu-aarch64:M::\x7fELF\x02\x01\x01\x00\x00\x00\x00\x00\x00\x00\x00\x00\x02\x00\xb7\x00:\xff\xff\xff\xff\xff\xff\xff\x00\xff\xff\xff\xff\xff\xff\xff\xff\xfe\xff\xff\xff:'"$QEMU_DIR"'/usr/bin/qemu-aarch64:FPC' \
            > /proc/sys/fs/binfmt_misc/register \
            || fail "could not register $QEMU_DIR/usr/bin/qemu-aarch64 for arm64 binaries"
    fi
    say "emulation: arm64 binaries run through $(sed -n 's/^interpreter //p' /proc/sys/fs/binfmt_misc/qemu-aarch64)"
fi

# -- 2. base image -----------------------------------------------------------------------------
image_present() { docker image inspect "$1" >/dev/null 2>&1; }
# present and of the wanted architecture (a tag of another architecture does not count)
image_fits() {
    [ "$(docker image inspect --format '{{.Architecture}}' "$1" 2>/dev/null)" = "$arch" ]
}

make_local_base() {
    command -v debootstrap >/dev/null 2>&1 \
        || fail "no base image and no debootstrap to make one (apt-get install debootstrap, or --install)"
    is_root || fail "debootstrap needs root"
    local rootfs
    rootfs="$(mktemp -d /var/tmp/fedcybgd-rootfs.XXXXXX)"
    # shellcheck disable=SC2064
    trap "rm -rf '$rootfs'" EXIT
    say "base image: debootstrap --arch $arch --variant=minbase bookworm from $DEBIAN_MIRROR (a few minutes; longer emulated)"
    debootstrap --arch "$arch" --variant=minbase --include=python3,python3-venv,ca-certificates \
        bookworm "$rootfs" "$DEBIAN_MIRROR" >"$rootfs.log" 2>&1 \
        || { tail -20 "$rootfs.log" >&2; fail "debootstrap failed (full log: $rootfs.log)"; }
    rm -f "$rootfs.log"
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/* \
        "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/* "$rootfs"/usr/share/locale/*
    # `docker import` labels every image with the engine's own architecture; an image archive
    # written here carries the root's (docker load)
    python3 "$ROOT/scripts/rootfs_image.py" "$rootfs" "$arch" "$LOCAL_BASE" "$rootfs.tar" \
        && docker load -q -i "$rootfs.tar" >/dev/null \
        || { rm -f "$rootfs.tar"; fail "could not load the base image $LOCAL_BASE"; }
    rm -rf "$rootfs" "$rootfs.tar"
    trap - EXIT
    say "base image: made $LOCAL_BASE ($(docker image inspect --format '{{.Size}}' "$LOCAL_BASE" | awk '{printf "%.0f MB", $1/1e6}'))"
}

if [ -n "$base_image" ]; then
    image_present "$base_image" || docker pull --platform "linux/$arch" "$base_image" \
        || fail "--base-image $base_image is neither present nor pullable"
    image_fits "$base_image" || fail "--base-image $base_image is not a linux/$arch image"
    say "base image: $base_image (given)"
elif image_fits "$DEFAULT_BASE"; then
    base_image="$DEFAULT_BASE"
    say "base image: $DEFAULT_BASE is present"
elif image_fits "$LOCAL_BASE"; then
    base_image="$LOCAL_BASE"
    say "base image: $LOCAL_BASE (made earlier; $DEFAULT_BASE is not present)"
elif [ "$foreign" = 0 ] && timeout "$PULL_TIMEOUT" docker pull -q "$DEFAULT_BASE" >/dev/null 2>&1; then
    base_image="$DEFAULT_BASE"
    say "base image: pulled $DEFAULT_BASE"
else
    say "base image: $DEFAULT_BASE cannot be pulled; making $LOCAL_BASE"
    make_local_base
    base_image="$LOCAL_BASE"
fi

# -- 3. torch ----------------------------------------------------------------------------------
host_pip() {
    if [ -x "$ROOT/.venv/bin/pip" ]; then "$ROOT/.venv/bin/pip" "$@"
    else python3 -m pip "$@"; fi
}
mkdir -p "$EXTRA/wheels"
torch_spec="torch==$TORCH_VERSION" torch_index="$TORCH_INDEX" find_links=""
if curl -fsS --max-time 10 -o /dev/null "$TORCH_INDEX/torch/" 2>/dev/null; then
    say "torch: the CPU index answers; the image installs $torch_spec from it"
elif [ "$arch" = arm64 ]; then
    # Without the CPU index, PyPI's aarch64 torch: a CUDA build (its nvidia-* and triton
    # dependencies add ~3.5 GB to the image) that runs on the CPU as well
    wheel="$(ls "$EXTRA"/wheels/torch-"$TORCH_VERSION"-cp311-*aarch64.whl 2>/dev/null | head -1 || true)"
    if [ -z "$wheel" ]; then
        say "torch: the CPU index does not answer; asking the host's pip for PyPI's aarch64 wheel"
        host_pip download --quiet --no-deps --only-binary=:all: --python-version 3.11 \
            --platform "$WHEEL_PLATFORM" -d "$EXTRA/wheels" "torch==$TORCH_VERSION" \
            || fail "the host's pip cannot get torch==$TORCH_VERSION for $WHEEL_PLATFORM"
        wheel="$(ls "$EXTRA"/wheels/torch-"$TORCH_VERSION"-cp311-*aarch64.whl | head -1)"
    fi
    say "torch: docker-extra/wheels/$(basename "$wheel") (PyPI's: a CUDA build, ~3.5 GB more)"
    torch_index="" find_links="docker-extra/wheels"
else
    wheel="$(ls "$EXTRA"/wheels/torch-"$TORCH_VERSION"+cpu-cp311-*.whl 2>/dev/null | head -1 || true)"
    if [ -z "$wheel" ]; then
        say "torch: the CPU index does not answer; asking the host's pip for the CPU wheel"
        tmp="$(mktemp -d)"
        host_pip download --quiet --no-deps --only-binary=:all: --python-version 3.11 \
            --platform manylinux_2_28_x86_64 -d "$tmp" "torch==$TORCH_VERSION" \
            || fail "neither the CPU index nor the host's pip can get torch==$TORCH_VERSION"
        got="$(ls "$tmp"/torch-*.whl)"
        case "$(basename "$got")" in
            *+cpu-*) ;;
            *) rm -rf "$tmp"
               fail "the host's pip found $(basename "$got"), not a +cpu build (a CUDA build would pull GBs); put a torch CPU wheel in $EXTRA/wheels/" ;;
        esac
        # a hard link when on the same file system: no second copy on disk
        ln -f "$got" "$EXTRA/wheels/" 2>/dev/null || cp "$got" "$EXTRA/wheels/"
        rm -rf "$tmp"
        wheel="$EXTRA/wheels/$(basename "$got")"
        say "torch: copied $(basename "$wheel") into docker-extra/wheels/"
    else
        say "torch: the CPU index does not answer; using docker-extra/wheels/$(basename "$wheel")"
    fi
    torch_spec="torch==$TORCH_VERSION+cpu" torch_index="" find_links="docker-extra/wheels"
fi

# -- 4. CA certificates ------------------------------------------------------------------------
ca_bundle=""
host_cert="${PIP_CERT:-$(host_pip config get global.cert 2>/dev/null || true)}"
if [ -n "$host_cert" ] && [ -f "$host_cert" ]; then
    if ! cmp -s "$host_cert" "$EXTRA/ca-certificates.pem" 2>/dev/null; then
        cp "$host_cert" "$EXTRA/ca-certificates.pem"
        say "CA: copied the host pip's CA bundle ($host_cert) to docker-extra/ca-certificates.pem"
    else
        say "CA: docker-extra/ca-certificates.pem is the host pip's bundle ($host_cert)"
    fi
    ca_bundle="docker-extra/ca-certificates.pem"
else
    rm -f "$EXTRA/ca-certificates.pem"
    say "CA: the host's pip uses no CA bundle of its own; none added"
fi

# -- 5. build arguments ------------------------------------------------------------------------
new_env="$(cat <<EOF
# Written by scripts/prepare-docker-offline.sh: build arguments for this machine.
#   docker-compose --env-file docker-extra/build.env build
FEDCYBGD_BASE_IMAGE=$base_image
FEDCYBGD_TORCH_SPEC=$torch_spec
FEDCYBGD_TORCH_INDEX_URL=$torch_index
FEDCYBGD_FIND_LINKS=$find_links
FEDCYBGD_PIP_EXTRA_CA=$ca_bundle
FEDCYBGD_PLATFORM=linux/$arch
FEDCYBGD_IMAGE=$IMAGE
EOF
)"
if [ -f "$ENV_FILE" ] && [ "$(cat "$ENV_FILE")" = "$new_env" ]; then
    say "build arguments: $ENV_FILE unchanged"
else
    printf '%s\n' "$new_env" >"$ENV_FILE"
    say "build arguments: wrote $ENV_FILE"
fi
[ "$quiet" = 1 ] || grep '^FEDCYBGD_' "$ENV_FILE" | sed 's/^/    /'

if [ "$build" = 1 ]; then
    command -v docker-compose >/dev/null 2>&1 || fail "no docker-compose (apt-get install docker-compose)"
    start=$(date +%s)
    if [ "$foreign" = 0 ]; then
        say "building: docker-compose --env-file ${ENV_FILE#"$ROOT/"} build"
        (cd "$ROOT" && docker-compose --env-file "$ENV_FILE" build)
    else
        # the same Dockerfile and arguments, for the other platform (every RUN step emulated)
        say "building: docker build --platform linux/$arch -t $IMAGE (emulated: tens of minutes)"
        args=()
        while IFS='=' read -r key value; do
            case "$key" in
                FEDCYBGD_BASE_IMAGE) args+=(--build-arg "BASE_IMAGE=$value") ;;
                FEDCYBGD_TORCH_SPEC) args+=(--build-arg "TORCH_SPEC=$value") ;;
                FEDCYBGD_TORCH_INDEX_URL) args+=(--build-arg "TORCH_INDEX_URL=$value") ;;
                FEDCYBGD_FIND_LINKS) args+=(--build-arg "FIND_LINKS=$value") ;;
                FEDCYBGD_PIP_EXTRA_CA) args+=(--build-arg "PIP_EXTRA_CA=$value") ;;
            esac
        done < "$ENV_FILE"
        (cd "$ROOT" && docker build --platform "linux/$arch" "${args[@]}" -t "$IMAGE" .)
    fi
    say "built $IMAGE in $(( $(date +%s) - start )) s"
fi
