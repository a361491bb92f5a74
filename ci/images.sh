#!/usr/bin/env bash
# Build the proxy, browser and netlock images from compose/Dockerfile.* with buildah, on a Debian base
# made here with mmdebstrap (no container registry is needed), and export each image's root filesystem.
#
#   ci/images.sh [--out DIR] [--suite trixie] [--only NAME[,NAME]] [--fresh-base]
#
# The Dockerfiles take the base from their BASE build argument; its default stays python:3.12-slim-bookworm,
# what a Docker user pulls. Here BASE is localhost/egresswall-base:<suite>: Debian's minbase with
# ca-certificates, made by mmdebstrap from Debian's own mirror (the Dockerfiles' ci/install.sh then installs
# Debian's python3, like every other package, since the base has no Python). It is made once and reused
# while the suite and the package list stay the same (--fresh-base makes it again).
#
# For each image NAME (proxy, browser, netlock) this writes, under --out (default build/images):
#   NAME/rootfs/     the image's root filesystem
#   NAME/image.json  `buildah inspect` of the image: its user, environment, entrypoint, command, health check
#   times.txt        seconds per step
# The images are also left in buildah's local storage as localhost/egresswall/NAME:<version>.
#
# A build machine whose package registries are reached through a TLS-inspecting proxy trusts that proxy's CA
# through its own CA bundle: that bundle is handed to the builds as the secret `build-ca`, which pip uses for
# the install step and which no image keeps (EGRESSWALL_BUILD_CA=FILE names another bundle, =none passes none).
#
# Needs root, buildah and mmdebstrap (ci/install.sh --images installs them).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out="$here/build/images"
suite=trixie
only=""
fresh_base=0
mirror="${EGRESSWALL_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
security_mirror="${EGRESSWALL_DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}"

usage() { sed -n '2,23p' "$0"; }
while [ $# -gt 0 ]; do
  case "$1" in
    --out) out=$(realpath -m "$2"); shift 2 ;;
    --out=*) out=$(realpath -m "${1#--out=}"); shift ;;
    --suite) suite="$2"; shift 2 ;;
    --suite=*) suite="${1#--suite=}"; shift ;;
    --only) only="$2"; shift 2 ;;
    --only=*) only="${1#--only=}"; shift ;;
    --fresh-base) fresh_base=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "images.sh: unknown option $1" >&2; exit 2 ;;
  esac
done

say() { printf 'images: %s\n' "$*" >&2; }
die() { printf 'images.sh: %s\n' "$*" >&2; exit 1; }

[ "$(id -u)" -eq 0 ] || die "needs root (buildah --isolation chroot and mmdebstrap's root mode)"
for tool in buildah mmdebstrap; do
  command -v "$tool" >/dev/null || die "$tool is missing: run ci/install.sh --images"
done

# The image names and their version: the ones compose/docker-compose.yml and the manifests use.
version=$(sed -n 's/^version = "\(.*\)"/\1/p' "$here/pyproject.toml" | head -n1)
[ -n "$version" ] || die "no version in pyproject.toml"
images=(proxy browser netlock)
if [ -n "$only" ]; then
  IFS=, read -r -a images <<< "$only"
  for name in "${images[@]}"; do
    [ -f "$here/compose/Dockerfile.$name" ] || die "no compose/Dockerfile.$name (--only $only)"
  done
fi

mkdir -p "$out"
times="$out/times.txt"
: > "$times"
started_all=$SECONDS
step() {  # step NAME SECONDS: record how long a step took
  printf '%-16s %5d s\n' "$1" "$2" | tee -a "$times" >&2
}

# ---- the base: Debian minbase from Debian's mirror ---------------------------------------------------------

base_packages="ca-certificates"
base="localhost/egresswall-base:$suite"
# What the base is made of; a base whose label differs is made again.
base_key=$(printf '%s\n' "$suite" "$base_packages" "$mirror" "$security_mirror" "$(mmdebstrap --version)" |
           sha256sum | cut -c1-16)
have_key=$(buildah inspect --type image --format '{{index .ImageAnnotations "egresswall.base-key"}}' "$base" \
           2>/dev/null || true)
if [ "$fresh_base" -eq 1 ] || [ "$have_key" != "$base_key" ]; then
  t=$SECONDS
  say "making $base with mmdebstrap (Debian $suite, minbase + $base_packages)"
  tmp=$(mktemp -d /var/tmp/egresswall-base.XXXXXX)
  trap 'rm -rf "$tmp"' EXIT
  # Security updates too: the browser image gets Debian's current chromium.
  mmdebstrap --quiet --variant=minbase --format=tar --include="$base_packages" \
    --aptopt='Acquire::Retries "3"' \
    "$suite" "$tmp/base.tar" \
    "deb $mirror $suite main" "deb $mirror $suite-updates main" "deb $security_mirror $suite-security main"
  ctr=$(buildah from --quiet scratch)
  buildah add --quiet "$ctr" "$tmp/base.tar" / >/dev/null
  buildah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin --env LANG=C.UTF-8 \
    --cmd /bin/bash --annotation "egresswall.base-key=$base_key" "$ctr"
  buildah commit --quiet --rm "$ctr" "$base" >/dev/null
  rm -rf "$tmp"; trap - EXIT
  step base $((SECONDS - t))
else
  say "reusing $base (same suite, packages and mirror)"
  step base 0
fi

# ---- the images --------------------------------------------------------------------------------------------

build_ca="${EGRESSWALL_BUILD_CA:-/etc/ssl/certs/ca-certificates.crt}"
secret=()
if [ "$build_ca" != none ]; then
  [ -s "$build_ca" ] || die "no CA bundle at $build_ca (EGRESSWALL_BUILD_CA=none to pass none)"
  secret=(--secret "id=build-ca,src=$build_ca")
fi

for name in "${images[@]}"; do
  t=$SECONDS
  tag="localhost/egresswall/$name:$version"
  say "building $tag from compose/Dockerfile.$name"
  # --layers: an unchanged step (the base, an apt step before the sources are copied) is reused.
  # --format docker keeps HEALTHCHECK, which the OCI image format has no field for.
  buildah bud --quiet --isolation chroot --layers --format docker \
    --file "$here/compose/Dockerfile.$name" --ignorefile "$here/compose/Dockerfile.$name.dockerignore" \
    --build-arg "BASE=$base" "${secret[@]}" --tag "$tag" "$here" >/dev/null
  step "build $name" $((SECONDS - t))

  t=$SECONDS
  dest="$out/$name"
  rm -rf "$dest"; mkdir -p "$dest"
  buildah inspect --type image "$tag" > "$dest/image.json"
  ctr=$(buildah from --quiet --pull-never "$tag")
  mnt=$(buildah mount "$ctr")
  mkdir -p "$dest/rootfs"
  cp -a "$mnt/." "$dest/rootfs/"
  buildah umount "$ctr" >/dev/null
  buildah rm "$ctr" >/dev/null
  step "export $name" $((SECONDS - t))
done

# Images no tag leads to any more (earlier builds' source and install layers) would fill the disk build
# after build. `rmi --prune` removes untagged images without children, so a few rounds remove a whole
# stale chain and keep the layers the current images are built on (the cache of the next build).
for _ in 1 2 3 4 5 6; do
  [ -n "$(buildah images --quiet --filter dangling=true 2>/dev/null)" ] || break
  buildah rmi --prune >/dev/null 2>&1 || break
done
step total $((SECONDS - started_all))
say "root filesystems in $out (times in $times)"
