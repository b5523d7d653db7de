#!/usr/bin/env bash
# Install storefs system-wide, or remove it again.
#
#   packaging/install.sh              build (swift build -c release) and install
#   packaging/install.sh --uninstall  remove what it installed
#
# Installs $PREFIX/bin/storefs and $PREFIX/share/man/man8/storefs.8 (PREFIX defaults to
# /usr/local). /usr/local/bin matters: mount.fuse3 starts the program named by the
# "fuse.storefs" type through sh with the default PATH, so `mount -t fuse.storefs` and fstab
# lines find it there. DESTDIR=DIR stages the files under DIR (for packagers);
# STOREFS_BIN=FILE installs that binary instead of building one.
# Builds as the calling user; only the copying uses sudo when it must.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
PREFIX=${PREFIX:-/usr/local}
DESTDIR=${DESTDIR:-}
BIN_DST="$DESTDIR$PREFIX/bin/storefs"
MAN_DST="$DESTDIR$PREFIX/share/man/man8/storefs.8"

die() { echo "install.sh: $*" >&2; exit 1; }

# as_root CMD...: run CMD directly when we may write there, else through sudo.
as_root() {
    if [ "$(id -u)" -eq 0 ] || [ -n "$DESTDIR" ]; then
        "$@"
    elif command -v sudo >/dev/null 2>&1; then
        sudo "$@"
    else
        die "need root to write under $PREFIX: run as root, or set PREFIX/DESTDIR"
    fi
}

case ${1:-} in
    --uninstall)
        as_root rm -f "$BIN_DST" "$MAN_DST"
        echo "removed $BIN_DST and $MAN_DST"
        exit 0
        ;;
    -h | --help)
        sed -n '2,13p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
        exit 0
        ;;
    "") ;;
    *) die "unknown argument '$1' (use --uninstall or --help)" ;;
esac

bin=${STOREFS_BIN:-}
if [ -z "$bin" ]; then
    command -v swift >/dev/null 2>&1 || die "swift not found on PATH: install a Swift 6 toolchain first"
    swift build -c release --product storefs
    bin=.build/release/storefs
fi
[ -x "$bin" ] || die "no storefs binary at $bin"

as_root install -D -m 0755 "$bin" "$BIN_DST"
as_root install -D -m 0644 man/storefs.8 "$MAN_DST"
echo "installed $BIN_DST and $MAN_DST"

case "$PREFIX/bin" in
    /usr/local/bin | /usr/bin | /bin) ;;
    *) echo "note: $PREFIX/bin is not on mount.fuse3's default PATH; 'mount -t fuse.storefs' needs a link in /usr/local/bin" >&2 ;;
esac

cat <<'USAGE'

Mount (read-only):
  storefs -o anonymous my-public-bucket /mnt/store
  storefs -o token_file=/etc/storefs/token gs://my-bucket/photos /mnt/photos
  mount -t fuse.storefs gs://my-bucket /mnt/store -o token_file=/etc/storefs/token,allow_other
Unmount:
  umount /mnt/store          (or fusermount3 -u /mnt/store as the user who mounted it)
At boot, an /etc/fstab line (more in packaging/fstab.example):
  my-bucket  /mnt/store  fuse.storefs  ro,_netdev,nofail,allow_other,token_file=/etc/storefs/token  0  0
Reference: man storefs
USAGE
