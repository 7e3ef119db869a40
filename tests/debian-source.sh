# Sourced by tests/build-libfuse.sh and tests/build-curl.sh: fetches a Debian source package
# through a private apt directory, never touching the machine's apt state.
#
# - `deb-src` entries are written into $root/apt-src (its own sources, lists and cache): one for
#   each `deb` entry of the machine's own sources (/etc/apt/sources.list.d/debian.sources, else
#   /etc/apt/sources.list: the same archives, suites and security updates the machine installs
#   from), and the suites a caller adds (sid, trixie) on the first archive. No host is written
#   anywhere in the repository.
# - `apt-get source` checks what it fetches against the archive's signed Release (the keyring
#   the machine's sources name).
# Callers: debsrc_setup "EXTRA SUITES" || exit 0; then debsrc_versions PKG, debsrc_fetch PKG=VER DIR.
# Messages go to stderr through the caller's `say`.

apt_dir=$root/apt-src
apt_opts=(-o "Dir::Etc::sourcelist=/dev/null" -o "Dir::Etc::sourceparts=$apt_dir/sources"
          -o "Dir::State=$apt_dir" -o "Dir::State::lists=$apt_dir/lists"
          -o "Dir::Cache=$apt_dir/cache" -o "Dir::State::status=/var/lib/dpkg/status"
          -o "APT::Sandbox::User=root" -q)

# The machine's `deb` entries as "URI|SUITES|KEYRING" lines (deb822 first, then the one-line form).
debsrc_machine_entries() {
  if [ -f /etc/apt/sources.list.d/debian.sources ]; then
    awk '
      function flush() { if (types ~ /(^| )deb( |$)/ && uri != "") print uri "|" suites "|" key; types = uri = suites = key = "" }
      /^[[:space:]]*$/ { flush(); next }
      /^Types:/ { types = substr($0, 8) }
      /^URIs:/ { uri = $2 }
      /^Suites:/ { suites = substr($0, 9) }
      /^Signed-By:/ { key = $2 }
      END { flush() }' /etc/apt/sources.list.d/debian.sources
  fi
  if [ -f /etc/apt/sources.list ]; then
    awk '$1 == "deb" && $2 !~ /^\[/ { print $2 "|" $3 "|" }
         $1 == "deb" && $2 ~ /^\[/ { print $3 "|" $4 "|" }' /etc/apt/sources.list
  fi
}

# Writes the private sources (the machine's archives, plus EXTRA suites on the first one) and
# updates their lists. Returns non-zero, having said why, when that cannot be done.
debsrc_setup() {
  local extra=$1 default_key=/usr/share/keyrings/debian-archive-keyring.gpg
  local entries
  entries=$(debsrc_machine_entries)
  if [ -z "$entries" ]; then
    say "no Debian archive address on this machine"
    return 1
  fi
  mkdir -p "$apt_dir"/lists/partial "$apt_dir"/cache/archives/partial "$apt_dir"/sources "$apt_dir"/work
  exec 9>"$apt_dir.lock"
  flock 9
  local out=$apt_dir/sources/ucpfs-src.sources first=1 uri suites key
  : >"$out"
  while IFS='|' read -r uri suites key; do
    [ -n "$key" ] || key=$default_key
    if [ ! -f "$key" ]; then
      say "no keyring $key for $uri"
      continue
    fi
    if ((first)) && [ -n "$extra" ]; then suites="$suites $extra"; fi
    first=0
    printf 'Types: deb-src\nURIs: %s\nSuites: %s\nComponents: main\nSigned-By: %s\n\n' \
      "$uri" "$(echo $suites)" "$key" >>"$out"
  done <<<"$entries"
  if [ ! -s "$out" ]; then
    say "no Debian archive with a keyring on this machine"
    return 1
  fi
  if ! apt-get "${apt_opts[@]}" update >"$apt_dir/update.log" 2>&1; then
    say "apt-get update of the source lists failed ($apt_dir/update.log)"
    return 1
  fi
  return 0
}

# The versions of source package PKG the private lists hold, one per line.
debsrc_versions() {
  apt-cache "${apt_opts[@]}" showsrc "$1" 2>/dev/null | awk '/^Version:/ {print $2}' | sort -uV
}

# Fetches and unpacks PKG=VERSION into DIR (apt checks its signature). Returns non-zero on failure
# (the log is DIR/source.log).
debsrc_fetch() {
  mkdir -p "$2"
  (cd "$2" && apt-get "${apt_opts[@]}" source "$1" >"$2/source.log" 2>&1)
}
